"""The tail-latency board, declared once: which panels, where, reading which query.

Both renderers read this list: `dashboards/build.py` turns it into Grafana JSON
and `pipeline/board.py` into a local HTML page. The SQL itself is never written
here: every panel names a query of `pipeline.store.queries.QUERIES`, the same
text `batchtide report` runs, so Grafana, the local board and the report cannot
disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

PanelKind = Literal["timeseries", "barchart"]
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
    """Name of the query in pipeline.store.queries.QUERIES."""
    fmt: QueryFormat
    unit: str
    description: str
    x: int
    y: int
    w: int
    h: int
    thresholds: tuple[Threshold, ...] = ()
    field_units: dict[str, str] = field(default_factory=dict)
    """Columns with another unit, drawn on a right-hand axis (e.g. tokens/s beside req/s)."""
    hidden: tuple[str, ...] = ()
    """Columns the shared query returns that this panel does not draw."""
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
        PanelSpec(
            key="tail_latency",
            title="p99 / p999 over time",
            kind="timeseries",
            query="latency_quantiles",
            fmt="time_series",
            unit="ms",
            description=(
                "End-to-end and queue-wait p99/p999 per time bucket. If e2e rises but "
                "queue wait does not, the time is spent in compute (backend); if wait "
                "rises with it, look at the window, the cap and the arrival rate. "
                "Dashed lines: 1 s and 2 s."
            ),
            x=0, y=0, w=12, h=8,
            thresholds=_SLO_MS,
            hidden=("requests", "e2e_p50_ms", "wait_p50_ms"),
        ),
        PanelSpec(
            key="batch_sizes",
            title="Batch size distribution",
            kind="barchart",
            query="batch_sizes",
            fmt="table",
            unit="short",
            description=(
                "Batches per size in the range. A spike at the hard cap means bursts "
                "fill the cap: check per-batch compute at that size before raising it. "
                "Sizes unchanged while p99 grew points at the backend, not the window."
            ),
            x=12, y=0, w=6, h=8,
            x_field="size",
            hidden=("share",),
        ),
        PanelSpec(
            key="wait_distribution",
            title="Queue wait distribution",
            kind="barchart",
            query="wait_histogram",
            fmt="table",
            unit="short",
            description=(
                "Requests per queue-wait bucket (x: upper bound in ms, Kafka record "
                "time to dispatch). A long right tail with small batches is a "
                "window/backlog problem; waits over 1000 ms are the ones users feel."
            ),
            x=18, y=0, w=6, h=8,
            x_field="wait_le_ms",
        ),
        PanelSpec(
            key="device_memory",
            title="Device memory",
            kind="barchart",
            query="device_memory",
            fmt="table",
            unit="bytes",
            description=(
                "Per-batch device memory, p50 and max over the range (CUDA max "
                "allocated, or process RSS on CPU). Max far above p50 means the "
                "largest batches set the memory: keep peaks below ~80% of the device."
            ),
            x=0, y=8, w=5, h=7,
            x_field="device_mem_kind",
        ),
        PanelSpec(
            key="throughput",
            title="Throughput",
            kind="timeseries",
            query="throughput",
            fmt="time_series",
            unit="reqps",
            description=(
                "Requests/s (left axis) and tokens/s (right axis) answered. Flat while "
                "p99 climbs: the device is saturated, lower the cap or add consumers; "
                "falling at equal load: the model got slower."
            ),
            x=5, y=8, w=9, h=7,
            field_units={"tokens_in_per_s": "tokens/s", "tokens_out_per_s": "tokens/s"},
        ),
        PanelSpec(
            key="target_hit_ratio",
            title="Target hit ratio, busy vs idle",
            kind="barchart",
            query="target_hit_ratio",
            fmt="table",
            unit="percentunit",
            description=(
                "Share of batches that reached target_size, split by load. About 0.9 "
                "busy and 0.6 idle is healthy; low when busy means the window is too "
                "short or the target too high for the arrival rate."
            ),
            x=14, y=8, w=5, h=7,
            thresholds=(Threshold(0.5, "orange"), Threshold(0.8, "green")),
            base_color="red",
            max_value=1.0,
            x_field="load",
            hidden=("batches", "mean_size"),
        ),
        PanelSpec(
            key="long_waits",
            title="Requests waiting > 1 s",
            kind="timeseries",
            query="long_waits",
            fmt="time_series",
            unit="percentunit",
            description=(
                "Share of requests whose queue wait exceeded one second. The field "
                "report moved it from ~4% to ~0.6%; a rise with unchanged batch sizes "
                "is the backend, a rise with full batches at the cap is load."
            ),
            x=19, y=8, w=5, h=7,
            thresholds=(Threshold(0.01, "orange"), Threshold(0.04, "red")),
        ),
        PanelSpec(
            key="tail_marked_share",
            title="Tail-marked share",
            kind="timeseries",
            query="tail_marking",
            fmt="time_series",
            unit="percentunit",
            description=(
                "Share of requests marked as tail (waited > tail_mark_ratio x p50 "
                "wait). A few percent is expected; a large share means the mark "
                "threshold is too low and marking no longer means anything."
            ),
            x=0, y=15, w=6, h=7,
            thresholds=(Threshold(0.05, "orange"), Threshold(0.2, "red")),
            hidden=("marked_wait_p99_ms", "unmarked_wait_p99_ms"),
        ),
        PanelSpec(
            key="marked_vs_unmarked",
            title="Marked vs unmarked p99 wait",
            kind="timeseries",
            query="tail_marking",
            fmt="time_series",
            unit="ms",
            description=(
                "p99 queue wait of marked and unmarked requests. Marked requests go "
                "first, so after marking their wait should stop growing; the field "
                "report saw 0.9 s marked vs 1.2 s unmarked."
            ),
            x=6, y=15, w=6, h=7,
            thresholds=_SLO_MS,
            hidden=("marked_share",),
        ),
        PanelSpec(
            key="window",
            title="Batching window vs arrival rate",
            kind="timeseries",
            query="window_over_time",
            fmt="time_series",
            unit="ms",
            description=(
                "Mean window per dispatch (left) and arrival rate (right). The window "
                "should shrink when busy and grow toward max_wait_ms when idle; a "
                "window pinned at max_wait_ms under load is a static knob again."
            ),
            x=12, y=15, w=6, h=7,
            field_units={"arrival_rate_per_s": "reqps"},
            hidden=("mean_batch_size", "effective_cap"),
        ),
        PanelSpec(
            key="dispatch_reasons",
            title="Dispatch reasons",
            kind="barchart",
            query="dispatch_reasons",
            fmt="table",
            unit="short",
            description=(
                "Why batches left: target, hard_cap, max_wait, idle. Mostly hard_cap "
                "means bursts fill the cap (check compute at the cap); mostly "
                "max_wait under load means the target is out of reach."
            ),
            x=18, y=15, w=6, h=7,
            x_field="reason",
            hidden=("share",),
        ),
        PanelSpec(
            key="compute_over_time",
            title="Per-batch compute time by batch size",
            kind="timeseries",
            query="compute_over_time",
            fmt="time_series",
            unit="ms",
            description=(
                "p50 compute per batch and per request (left) against mean batch "
                "size (right). Batch sizes unchanged but compute time up -> backend "
                "(a heavier model), not the window: lower that model's cap."
            ),
            x=0, y=22, w=14, h=8,
            field_units={"mean_batch_size": "short"},
        ),
        PanelSpec(
            key="compute_curve",
            title="Compute time vs batch size",
            kind="barchart",
            query="compute_by_batch_size",
            fmt="table",
            unit="ms",
            description=(
                "p50/p99 compute per batch size in the range: the cost curve t(b). "
                "Where it bends upward the model stops being batch friendly; the "
                "effective cap belongs at that knee."
            ),
            x=14, y=22, w=10, h=8,
            x_field="size",
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
        PanelSpec(
            key="consumer_lag",
            title="Consumer lag (records)",
            kind="timeseries",
            query="lag_over_time",
            fmt="time_series",
            unit="short",
            description=(
                "End offset minus committed offset, summed over the model's request partitions "
                "(each partition's last sample in the bucket). Growing while throughput is flat: "
                "the group cannot keep up, add consumers or partitions; a sawtooth is bursts draining."
            ),
            x=0, y=0, w=8, h=8,
            hidden=("lag_age_ms",),
        ),
        PanelSpec(
            key="consumer_lag_age",
            title="Lag age (oldest unanswered record)",
            kind="timeseries",
            query="lag_over_time",
            fmt="time_series",
            unit="ms",
            description=(
                "How long the oldest record not yet answered has waited (its Kafka CreateTime to the "
                "sample), max over partitions. This is what a user waits for; lag in records hides it "
                "when requests are slow. Dashed line: the lag-age alert's default, 60 s."
            ),
            x=8, y=0, w=8, h=8,
            thresholds=(Threshold(60_000.0, "red"),),
            hidden=("lag",),
        ),
        PanelSpec(
            key="engine_state",
            title="Engine state reported by the consumers",
            kind="timeseries",
            query="engine_state",
            fmt="time_series",
            unit="ms",
            description=(
                "Window (left), learned cap and engine queue (right), averaged over the consumers' "
                "lag samples. A queue that grows with the window pinned at max_wait_ms: the device "
                "is the limit; a cap falling while lag grows: the model got heavier."
            ),
            x=16, y=0, w=8, h=8,
            field_units={"effective_cap": "short", "queue": "short"},
            hidden=("marked_share",),
        ),
    ),
    refresh="10s",
)

BOARDS: tuple[BoardSpec, ...] = (TAIL_LATENCY, CONSUMER_LAG)
