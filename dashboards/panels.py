"""The tail-latency board, declared once: which panels, where, reading which query.

Both renderers read this list: `dashboards/build.py` turns it into Grafana JSON
and `pipeline/tools/views/board.py` into a local HTML page. The SQL itself is never written
here: every panel names a query of `pipeline.core.store.queries.QUERIES`, the same
text `batchtide report` runs, so Grafana, the local board and the report cannot
disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

PanelKind = Literal["timeseries", "barchart", "table"]
QueryFormat = Literal["time_series", "table"]

DATASOURCE_TYPE = "grafana-clickhouse-datasource"
DATASOURCE_UID = "batchtide-clickhouse"
DATASOURCE_NAME = "batchtide ClickHouse"
FOLDER_UID = "batchtide"
FOLDER_TITLE = "batchtide"
MODEL_VARIABLE = "model"
MODELS_QUERY = "models"
"""Query listing the models seen in the time range (the `model` template variable)."""


@dataclass(frozen=True)
class Threshold:
    value: float
    color: str


@dataclass(frozen=True)
class PanelSpec:
    """One panel: what it shows, how to read it, where it sits on a 24-column grid."""

    key: str
    title: str
    kind: PanelKind
    query: str
    """Name of the query in pipeline.core.store.queries.QUERIES."""
    fmt: QueryFormat
    unit: str
    description: str
    x: int
    y: int
    w: int
    h: int
    thresholds: tuple[Threshold, ...] = ()
    field_units: dict[str, str] = field(default_factory=dict)
    """Columns with another unit, drawn on a right-hand axis (e.g. tokens/s beside req/s); in a table, that
    column's unit."""
    hidden: tuple[str, ...] = ()
    """Columns the shared query returns that this panel does not draw (or, in a table, does not show)."""
    stacked: bool = False
    max_value: float | None = None
    """Fixed top of the value axis (1.0 for ratios), else it follows the data."""
    x_field: str | None = None
    """Bar charts: the column on the x axis (default: the first non-numeric column)."""
    base_color: str = "green"
    """Colour below the first threshold (red when low values are the bad ones)."""

    @property
    def format_code(self) -> int:
        """The ClickHouse plugin's `format`: 0 time series, 1 table."""
        return 0 if self.fmt == "time_series" else 1


@dataclass(frozen=True)
class BoardSpec:
    uid: str
    title: str
    description: str
    tags: tuple[str, ...]
    panels: tuple[PanelSpec, ...]
    default_range: str = "now-1h"
    refresh: str = "30s"


def timeseries(
    key: str, title: str, query: str, unit: str, at: tuple[int, int, int, int], description: str, **options: Any
) -> PanelSpec:
    """A time-series panel at (x, y, w, h) on the grid; its query returns the plugin's time_series format."""
    x, y, w, h = at
    return PanelSpec(key, title, "timeseries", query, "time_series", unit, description, x, y, w, h, **options)


def bars(
    key: str,
    title: str,
    query: str,
    unit: str,
    at: tuple[int, int, int, int],
    x_field: str,
    description: str,
    **options: Any,
) -> PanelSpec:
    """A bar chart at (x, y, w, h) with `x_field` on its x axis; its query returns a table."""
    x, y, w, h = at
    return PanelSpec(key, title, "barchart", query, "table", unit, description, x, y, w, h, x_field=x_field, **options)


def table(
    key: str, title: str, query: str, unit: str, at: tuple[int, int, int, int], description: str, **options: Any
) -> PanelSpec:
    """A table at (x, y, w, h): one row per query row, `unit` for numbers unless `field_units` says otherwise."""
    x, y, w, h = at
    return PanelSpec(key, title, "table", query, "table", unit, description, x, y, w, h, **options)


_SLO_MS = (Threshold(1000.0, "orange"), Threshold(2000.0, "red"))

TAIL_LATENCY = BoardSpec(
    uid="batchtide-tail-latency",
    title="batchtide — tail latency",
    description=(
        "One screen per model to tell a window problem from a backend problem: "
        "tail latency, batch sizes, queue waits, device memory and per-batch compute."
    ),
    tags=("batchtide", "latency", "clickhouse"),
    panels=(
        timeseries(
            "tail_latency",
            "p99 / p999 over time",
            "latency_quantiles",
            "ms",
            (0, 0, 12, 8),
            "End-to-end and queue-wait p99/p999 per time bucket. If e2e rises but queue wait does not, the "
            "time is spent in compute (backend); if wait rises with it, look at the window, the cap and the "
            "arrival rate. Dashed lines: 1 s and 2 s.",
            thresholds=_SLO_MS,
            hidden=("requests", "e2e_p50_ms", "wait_p50_ms"),
        ),
        bars(
            "batch_sizes",
            "Batch size distribution",
            "batch_sizes",
            "short",
            (12, 0, 6, 8),
            "size",
            "Batches per size in the range. A spike at the hard cap means bursts fill the cap: check "
            "per-batch compute at that size before raising it. Sizes unchanged while p99 grew points at the "
            "backend, not the window.",
            hidden=("share",),
        ),
        bars(
            "wait_distribution",
            "Queue wait distribution",
            "wait_histogram",
            "short",
            (18, 0, 6, 8),
            "wait_le_ms",
            "Requests per queue-wait bucket (x: upper bound in ms, Kafka record time to dispatch). A long "
            "right tail with small batches is a window/backlog problem; waits over 1000 ms are the ones users"
            " feel.",
        ),
        bars(
            "device_memory",
            "Device memory",
            "device_memory",
            "bytes",
            (0, 8, 5, 7),
            "device_mem_kind",
            "Per-batch device memory, p50 and max over the range (CUDA max allocated, or process RSS on CPU)."
            " Max far above p50 means the largest batches set the memory: keep peaks below ~80% of the "
            "device.",
        ),
        timeseries(
            "throughput",
            "Throughput",
            "throughput",
            "reqps",
            (5, 8, 9, 7),
            "Requests/s (left axis) and tokens/s (right axis) answered. Flat while p99 climbs: the device is "
            "saturated, lower the cap or add consumers; falling at equal load: the model got slower.",
            field_units={"tokens_in_per_s": "tokens/s", "tokens_out_per_s": "tokens/s"},
        ),
        bars(
            "target_hit_ratio",
            "Target hit ratio, busy vs idle",
            "target_hit_ratio",
            "percentunit",
            (14, 8, 5, 7),
            "load",
            "Share of batches that reached target_size, split by load. About 0.9 busy and 0.6 idle is "
            "healthy; low when busy means the window is too short or the target too high for the arrival "
            "rate.",
            thresholds=(Threshold(0.5, "orange"), Threshold(0.8, "green")),
            base_color="red",
            max_value=1.0,
            hidden=("batches", "mean_size"),
        ),
        timeseries(
            "long_waits",
            "Requests waiting > 1 s",
            "long_waits",
            "percentunit",
            (19, 8, 5, 7),
            "Share of requests whose queue wait exceeded one second. The field report moved it from ~4% to "
            "~0.6%; a rise with unchanged batch sizes is the backend, a rise with full batches at the cap is "
            "load.",
            thresholds=(Threshold(0.01, "orange"), Threshold(0.04, "red")),
        ),
        timeseries(
            "tail_marked_share",
            "Tail-marked share",
            "tail_marking",
            "percentunit",
            (0, 15, 6, 7),
            "Share of requests marked as tail (waited > tail_mark_ratio x p50 wait). A few percent is "
            "expected; a large share means the mark threshold is too low and marking no longer means "
            "anything.",
            thresholds=(Threshold(0.05, "orange"), Threshold(0.2, "red")),
            hidden=("marked_wait_p99_ms", "unmarked_wait_p99_ms"),
        ),
        timeseries(
            "marked_vs_unmarked",
            "Marked vs unmarked p99 wait",
            "tail_marking",
            "ms",
            (6, 15, 6, 7),
            "p99 queue wait of marked and unmarked requests. Marked requests go first, so after marking their"
            " wait should stop growing; the field report saw 0.9 s marked vs 1.2 s unmarked.",
            thresholds=_SLO_MS,
            hidden=("marked_share",),
        ),
        timeseries(
            "window",
            "Batching window vs arrival rate",
            "window_over_time",
            "ms",
            (12, 15, 6, 7),
            "Mean window per dispatch (left) and arrival rate (right). The window should shrink when busy and"
            " grow toward max_wait_ms when idle; a window pinned at max_wait_ms under load is a static knob "
            "again.",
            field_units={"arrival_rate_per_s": "reqps"},
            hidden=("mean_batch_size", "effective_cap"),
        ),
        bars(
            "dispatch_reasons",
            "Dispatch reasons",
            "dispatch_reasons",
            "short",
            (18, 15, 6, 7),
            "reason",
            "Why batches left: target, hard_cap, max_wait, idle. Mostly hard_cap means bursts fill the cap "
            "(check compute at the cap); mostly max_wait under load means the target is out of reach.",
            hidden=("share",),
        ),
        timeseries(
            "compute_over_time",
            "Per-batch compute time by batch size",
            "compute_over_time",
            "ms",
            (0, 22, 14, 8),
            "p50 compute per batch and per request (left) against mean batch size (right). Batch sizes "
            "unchanged but compute time up -> backend (a heavier model), not the window: lower that model's "
            "cap.",
            field_units={"mean_batch_size": "short"},
        ),
        bars(
            "compute_curve",
            "Compute time vs batch size",
            "compute_by_batch_size",
            "ms",
            (14, 22, 10, 8),
            "size",
            "p50/p99 compute per batch size in the range: the cost curve t(b). Where it bends upward the "
            "model stops being batch friendly; the effective cap belongs at that knee.",
            hidden=("batches", "ms_per_request_p50"),
        ),
    ),
)

CONSUMER_LAG = BoardSpec(
    uid="batchtide-consumer-lag",
    title="batchtide — consumer lag",
    description=(
        "How far each model's consumer group is behind: records not yet answered, the age of the "
        "oldest of them, and the engine state the consumers report (consumers/lag.py)."
    ),
    tags=("batchtide", "kafka", "lag", "clickhouse"),
    panels=(
        timeseries(
            "consumer_lag",
            "Consumer lag (records)",
            "lag_over_time",
            "short",
            (0, 0, 8, 8),
            "End offset minus committed offset, summed over the model's request partitions "
            "(each partition's last sample in the bucket). Growing while throughput is flat: "
            "the group cannot keep up, add consumers or partitions; a sawtooth is bursts draining.",
            hidden=("lag_age_ms",),
        ),
        timeseries(
            "consumer_lag_age",
            "Lag age (oldest unanswered record)",
            "lag_over_time",
            "ms",
            (8, 0, 8, 8),
            "How long the oldest record not yet answered has waited (its Kafka CreateTime to the "
            "sample), max over partitions. This is what a user waits for; lag in records hides it "
            "when requests are slow. Dashed line: the lag-age alert's default, 60 s.",
            thresholds=(Threshold(60_000.0, "red"),),
            hidden=("lag",),
        ),
        timeseries(
            "engine_state",
            "Engine state reported by the consumers",
            "engine_state",
            "ms",
            (16, 0, 8, 8),
            "Window (left), learned cap and engine queue (right), averaged over the consumers' "
            "lag samples. A queue that grows with the window pinned at max_wait_ms: the device "
            "is the limit; a cap falling while lag grows: the model got heavier.",
            field_units={"effective_cap": "short", "queue": "short"},
            hidden=("marked_share",),
        ),
    ),
    refresh="10s",
)

GENERATION = BoardSpec(
    uid="batchtide-generation",
    title="batchtide — generation",
    description=(
        "Per-token objectives of generating models: time to first token, time per output token, and "
        "prompt and generated tokens/s apart. Models that do not generate have no rows here."
    ),
    tags=("batchtide", "generation", "clickhouse"),
    panels=(
        timeseries(
            "token_latency",
            "Time to first token and per output token",
            "token_timing",
            "ms",
            (0, 0, 12, 8),
            "TTFT (first token - Kafka record time: queue wait plus prefill) and TPOT ((last - first token) / "
            "(tokens - 1)), p50 and p99 per bucket. TTFT up with TPOT flat: requests wait or prefill longer "
            "(queue, longer prompts); TPOT up: decode steps got slower (a larger running batch, a heavier model).",
            hidden=("prompt_tokens_per_s", "generated_tokens_per_s"),
        ),
        timeseries(
            "token_rates",
            "Prompt and generated tokens/s",
            "token_timing",
            "tokens/s",
            (12, 0, 12, 8),
            "Prompt tokens/s (prefill work) and generated tokens/s (decode work) answered, apart: the machine's "
            "limits for the two differ by an order of magnitude, so a sum would hide which one is saturated.",
            hidden=("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"),
        ),
    ),
)

FLEET = BoardSpec(
    uid="batchtide-fleet",
    title="batchtide — consumers and outcomes",
    description=(
        "Which member of the model's consumer group holds the tail: e2e p99, throughput, batch size and "
        "measured capacity per consumer; and every request not answered ok, refusals included, by outcome "
        "and reason."
    ),
    tags=("batchtide", "fleet", "outcomes", "clickhouse"),
    panels=(
        timeseries(
            "consumer_p99",
            "e2e p99 by consumer",
            "consumer_latency",
            "ms",
            (0, 0, 12, 8),
            "Exact end-to-end p99 per consumer and bucket. One line far above the others is one slow device "
            "(an older card, a throttled or shared one, a hot partition) setting the group's p99. Dashed lines: "
            "1 s and 2 s.",
            thresholds=_SLO_MS,
            hidden=("requests_per_s",),
        ),
        timeseries(
            "consumer_throughput",
            "Requests/s by consumer",
            "consumer_latency",
            "reqps",
            (12, 0, 12, 8),
            "Requests each consumer ran per second. Equal rates with unequal p99: the partitions are split "
            "evenly but the devices are not equally fast.",
            hidden=("e2e_p99_ms",),
        ),
        table(
            "consumers",
            "By consumer",
            "consumers",
            "short",
            (0, 8, 16, 8),
            "Per consumer over the range: requests it ran and its share of the model's, e2e p50 / p99, req/s, "
            "mean batch size, its latest measured capacity (cap / t(cap); empty before its first batch) and its "
            "not-ok share. A slow device shows a high p99 with large batches and a low capacity.",
            hidden=("model",),
            field_units={
                "share": "percentunit",
                "e2e_p50_ms": "ms",
                "e2e_p99_ms": "ms",
                "requests_per_s": "reqps",
                "capacity_per_s": "reqps",
                "not_ok_share": "percentunit",
            },
        ),
        bars(
            "not_ok",
            "Not ok by outcome and reason",
            "not_ok_reasons",
            "percentunit",
            (16, 8, 8, 8),
            "cause",
            "Share of all the model's requests answered other than ok, per outcome and reason: refusals "
            "(rejected: too_long, schema, ...) beside expired (deadline) and error (runner_error, oversize). "
            "Refusals never ran, so no latency figure counts them; this panel does.",
            hidden=("requests",),
        ),
    ),
)

BOARDS: tuple[BoardSpec, ...] = (TAIL_LATENCY, CONSUMER_LAG, GENERATION, FLEET)
