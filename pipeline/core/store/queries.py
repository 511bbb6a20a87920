"""The analysis SQL, in one place: Grafana panels and `batchtide report` run these texts.

It is a long module on purpose: every query the boards, alerts and report run is
here and nowhere else, so a change to a table is checked against all of them at once.

Every query is written for the Grafana ClickHouse plugin (macros
`$__timeFilter`, `$__timeInterval`, `$__interval_s`, `$__fromTime`,
`$__toTime`, and the `model` template variable through
`$__conditionalAll(model IN (${model:sqlstring}), $model)`), and expanded for
`report` by `pipeline.core.store.macros.expand_macros` with the model bound as a
query parameter. Table names are unqualified: the Grafana datasource's and
the report client's default database decides where they run, and on a
cluster they name the Distributed tables, so the text is the same everywhere.

Exact figures read the raw tables with FINAL (collapses any duplicate a
racing second sink slipped in) and `quantileExactInclusive` (the R-7 /
numpy-default interpolation), so they can be checked independently. The
`*_rollup` queries read the per-minute AggregatingMergeTree tables: cheap at
any range, counts exact, quantiles from merged quantileTiming states (nearest
rank at 1 ms resolution below 1024 ms, 16 ms above, capped at 30 s), for
long-range board panels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MODEL_FILTER = "$__conditionalAll(model IN (${model:sqlstring}), $model)"
BUSY = "arrival_rate_per_s * (compute_ms + window_ms) / 1000 >= target_size"
"""A batch dispatched while busy: at the arrival rate of the moment, one device
cycle (compute plus window) brings at least a full target batch."""


@dataclass(frozen=True)
class AnalysisQuery:
    name: str
    title: str
    sql: str
    format: Literal["time_series", "table"]
    """Grafana target format: time_series (0) or table (1)."""
    description: str


def _q(name: str, title: str, fmt: Literal["time_series", "table"], description: str, sql: str) -> AnalysisQuery:
    return AnalysisQuery(name=name, title=title, sql=sql.strip(), format=fmt, description=description)


SERVED = "outcome != 'rejected'"
"""A request the engine took in (answered ok, expired or failed). A refused request (`rejected`,
batch_id -1, no compute) was answered within a few ms without running: counted in every outcome
share, never in a latency, wait, token or throughput figure, which it would pull down."""
OUTCOME_ROWS = f"FROM request_latency FINAL\nWHERE $__timeFilter(enqueue_time) AND NOT warmup AND {MODEL_FILTER}"
"""Every request of the range, refusals included: what outcome shares are taken over (warm-up left out)."""
LATENCY_ROWS = f"{OUTCOME_ROWS} AND {SERVED}"
"""The rows every latency figure reads: refusals and warm-up requests are left out (the `warmup` query counts
warm-up, `summary` and `not_ok_reasons` count refusals)."""
DATA_SPAN_S = (
    "greatest((toUnixTimestamp64Milli(max(produce_time)) - toUnixTimestamp64Milli(min(enqueue_time))) / 1000, 1)"
)
"""Seconds from the first request to the last answer in the range (at least 1): throughput is over
the span that has data, not over the range asked for (a 2-minute run reported over 3 h is not 0.3 req/s)."""
GENERATED_ROWS = f"{LATENCY_ROWS} AND toUnixTimestamp64Milli(first_token_time) > 0"
"""Answered generation requests: the rows that carry first/last token stamps."""
TTFT_MS = "toUnixTimestamp64Milli(first_token_time) - toUnixTimestamp64Milli(enqueue_time)"
TPOT_MS = "(toUnixTimestamp64Milli(last_token_time) - toUnixTimestamp64Milli(first_token_time)) / (tokens_out - 1)"
"""Time per output token after the first; defined only where tokens_out > 1."""
BATCH_ROWS = f"FROM batches FINAL\nWHERE $__timeFilter(dispatch_time) AND {MODEL_FILTER}"
EXACT_QUANTILES = (
    "quantilesExactInclusive(0.5, 0.99, 0.999)(e2e_ms) AS e2e",
    "quantilesExactInclusive(0.5, 0.99, 0.999)(wait_ms) AS wait",
)
QUANTILE_COLUMNS = (
    "e2e[1] AS e2e_p50_ms, e2e[2] AS e2e_p99_ms, e2e[3] AS e2e_p999_ms,\n"
    "    wait[1] AS wait_p50_ms, wait[2] AS wait_p99_ms, wait[3] AS wait_p999_ms"
)


def _columns(columns: tuple[str, ...]) -> str:
    return ",\n".join(f"    {c}" for c in columns)


def per_bucket(time_column: str, columns: tuple[str, ...], rows: str, *, ordered: bool = True) -> str:
    """A time series: one row per `$__timeInterval` bucket and model."""
    order = "\nORDER BY time, model" if ordered else ""
    return (
        f"SELECT\n    $__timeInterval({time_column}) AS time,\n    model,\n{_columns(columns)}\n"
        f"{rows}\nGROUP BY time, model{order}"
    )


def per_model(key: str, columns: tuple[str, ...], rows: str, *, order: str | None = None) -> str:
    """A table: one row per model and `key` (an expression, `... AS name` groups by the name)."""
    name = key.rsplit(" AS ", 1)[-1]
    return (
        f"SELECT\n    model,\n    {key},\n{_columns(columns)}\n"
        f"{rows}\nGROUP BY model, {name}\nORDER BY model, {order or name}"
    )


def quantile_series(time_column: str, requests: str, e2e: str, wait: str, rows: str) -> str:
    """p50/p99/p999 of e2e and wait per bucket, named the same for the raw and the rollup source."""
    inner = per_bucket(time_column, (f"{requests} AS requests", e2e, wait), rows, ordered=False)
    indented = "\n".join(f"    {line}" for line in inner.splitlines())
    return f"SELECT\n    time, model, requests,\n    {QUANTILE_COLUMNS}\nFROM (\n{indented}\n)\nORDER BY time, model"


def share_of_model(count: str) -> str:
    return f"{count} / sum({count}) OVER (PARTITION BY model) AS share"


_ALL = [
    _q("models", "Models seen in the range", "table",
       "The `model` template variable's options (not filtered by the variable itself).",
       "SELECT DISTINCT model\nFROM request_latency\nWHERE $__timeFilter(enqueue_time)\nORDER BY model"),
    _q("summary", "Per-model summary", "table",
       "Requests that ran, throughput over the span with data, exact e2e and queue-wait quantiles, long waits and "
       "tail marking over the range (warm-up requests left out); refusals counted apart and in the not-ok share.",
       f"""
SELECT
    model, requests, refused, span_s, requests_per_s, tokens_per_s,
    {QUANTILE_COLUMNS},
    share_wait_over_1s, marked_share, marked_wait_p99_ms, unmarked_wait_p99_ms, not_ok_share
FROM (
    SELECT
        model,
        countIf({SERVED}) AS requests,
        countIf(NOT {SERVED}) AS refused,
        {DATA_SPAN_S} AS span_s,
        requests / span_s AS requests_per_s,
        sumIf(tokens_in + tokens_out, {SERVED}) / span_s AS tokens_per_s,
        quantilesExactInclusiveIf(0.5, 0.99, 0.999)(e2e_ms, {SERVED}) AS e2e,
        quantilesExactInclusiveIf(0.5, 0.99, 0.999)(wait_ms, {SERVED}) AS wait,
        countIf({SERVED} AND wait_ms > 1000) / requests AS share_wait_over_1s,
        countIf({SERVED} AND tail_marked) / requests AS marked_share,
        quantileExactInclusiveIf(0.99)(wait_ms, {SERVED} AND tail_marked) AS marked_wait_p99_ms,
        quantileExactInclusiveIf(0.99)(wait_ms, {SERVED} AND NOT tail_marked) AS unmarked_wait_p99_ms,
        countIf(outcome != 'ok') / count() AS not_ok_share
    {OUTCOME_ROWS.replace(chr(10), chr(10) + "    ")}
    GROUP BY model
)
ORDER BY model
"""),
    _q("not_ok_reasons", "Not ok by outcome and reason", "table",
       "Every request not answered ok, refusals included, per outcome and reason (`rejected: too_long`, "
       "`expired: deadline`, ...), with its share of all the model's requests in the range.",
       f"""
SELECT model, cause, outcome, why AS reason, requests, share
FROM (
    SELECT
        model, outcome, if(reason = '', 'unspecified', reason) AS why,
        concat(outcome, ': ', why) AS cause,
        count() AS requests,
        count() / sum(count()) OVER (PARTITION BY model) AS share
    {OUTCOME_ROWS.replace(chr(10), chr(10) + "    ")}
    GROUP BY model, outcome, why
)
WHERE outcome != 'ok'
ORDER BY model, requests DESC, cause
"""),
    _q("warmup", "Warm-up requests (left out of every latency figure)", "table",
       "Requests their sender tagged as warm-up: answered and stored, counted here and nowhere else.",
       f"""
SELECT
    model,
    count() AS requests,
    quantileExactInclusive(0.5)(e2e_ms) AS e2e_p50_ms,
    max(e2e_ms) AS e2e_max_ms
FROM request_latency FINAL
WHERE $__timeFilter(enqueue_time) AND warmup AND {MODEL_FILTER}
GROUP BY model
ORDER BY model
"""),
    _q("latency_quantiles", "End-to-end and queue-wait p50 / p99 / p999", "time_series",
       "Exact quantiles per model and time bucket, from the raw rows.",
       quantile_series("enqueue_time", "count()", *EXACT_QUANTILES, LATENCY_ROWS)),
    _q("throughput", "Throughput: requests/s and tokens/s", "time_series",
       "Answered requests and tokens per second per bucket (edge buckets may be partial).",
       per_bucket("enqueue_time", (
           "count() / $__interval_s AS requests_per_s",
           "sum(tokens_in) / $__interval_s AS tokens_in_per_s",
           "sum(tokens_out) / $__interval_s AS tokens_out_per_s",
       ), LATENCY_ROWS)),
    _q("generation", "Generation: token rates, time to first token, time per output token", "table",
       "Per generating model over the span with data: prompt and generated tokens/s apart, TTFT "
       "(first token - enqueue) and TPOT ((last - first token) / (tokens_out - 1)) p50 / p99, exact.",
       f"""
SELECT
    model,
    count() AS requests,
    {DATA_SPAN_S} AS span_s,
    sum(tokens_in) / span_s AS prompt_tokens_per_s,
    sum(tokens_out) / span_s AS generated_tokens_per_s,
    quantilesExactInclusive(0.5, 0.99)({TTFT_MS}) AS ttft,
    ttft[1] AS ttft_p50_ms, ttft[2] AS ttft_p99_ms,
    quantilesExactInclusiveIf(0.5, 0.99)({TPOT_MS}, tokens_out > 1) AS tpot,
    tpot[1] AS tpot_p50_ms, tpot[2] AS tpot_p99_ms
{GENERATED_ROWS}
GROUP BY model
ORDER BY model
"""),
    _q("token_timing", "Generation: TTFT and time per output token p50 / p99, token rates", "time_series",
       "Per generating model and bucket; prompt and generated tokens/s apart (edge buckets may be partial).",
       per_bucket("enqueue_time", (
           f"quantileExactInclusive(0.5)({TTFT_MS}) AS ttft_p50_ms",
           f"quantileExactInclusive(0.99)({TTFT_MS}) AS ttft_p99_ms",
           f"quantileExactInclusiveIf(0.5)({TPOT_MS}, tokens_out > 1) AS tpot_p50_ms",
           f"quantileExactInclusiveIf(0.99)({TPOT_MS}, tokens_out > 1) AS tpot_p99_ms",
           "sum(tokens_in) / $__interval_s AS prompt_tokens_per_s",
           "sum(tokens_out) / $__interval_s AS generated_tokens_per_s",
       ), GENERATED_ROWS)),
    _q("long_waits", "Share of requests waiting > 1 s", "time_series",
       "Per bucket: share of requests whose queue wait exceeded one second.",
       per_bucket("enqueue_time", ("countIf(wait_ms > 1000) / count() AS share_wait_over_1s",), LATENCY_ROWS)),
    _q("tail_marking", "Tail marking: marked share, marked vs unmarked p99 wait", "time_series",
       "A large marked share means tail_mark_ratio is too low (everything is marked, so nothing is).",
       per_bucket("enqueue_time", (
           "countIf(tail_marked) / count() AS marked_share",
           "quantileExactInclusiveIf(0.99)(wait_ms, tail_marked) AS marked_wait_p99_ms",
           "quantileExactInclusiveIf(0.99)(wait_ms, NOT tail_marked) AS unmarked_wait_p99_ms",
       ), LATENCY_ROWS)),
    _q("wait_histogram", "Queue-wait distribution", "table",
       "Requests per wait bucket (upper bound in ms; inf for the rest).",
       per_model("arrayFirst(b -> wait_ms <= b, [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, inf]) AS wait_le_ms",
                 ("count() AS requests",), LATENCY_ROWS)),
    _q("batch_sizes", "Batch size distribution", "table",
       "Batches per size and their share of the model's batches.",
       per_model("size", ("count() AS batches", share_of_model("count()")), BATCH_ROWS)),
    _q("target_hit_ratio", "Target hit ratio, busy vs idle", "table",
       "Share of batches that reached target_size; busy = one device cycle at the arrival rate "
       "(compute + window) brings at least a target batch.",
       per_model(f"if({BUSY}, 'busy', 'idle') AS load",
                 ("count() AS batches", "avg(hit_target) AS hit_ratio", "avg(size) AS mean_size"), BATCH_ROWS)),
    _q("dispatch_reasons", "Dispatch reasons", "table",
       "Why batches left: hard_cap, target, max_wait, idle (and any other reason the engine reports).",
       per_model("reason", ("count() AS batches", share_of_model("count()")), BATCH_ROWS, order="batches DESC")),
    _q("device_memory", "Device memory p50 / max", "table",
       "Per-batch device memory (cuda max allocated, or process RSS on CPU).",
       per_model("device_mem_kind", (
           "quantileExactInclusive(0.5)(device_mem_bytes) AS mem_p50_bytes",
           "max(device_mem_bytes) AS mem_max_bytes",
       ), BATCH_ROWS)),
    _q("window_over_time", "Batching window, arrival rate and cap over time", "time_series",
       "How the adaptive window followed load: mean window, arrival rate, batch size and effective cap.",
       per_bucket("dispatch_time", (
           "avg(window_ms) AS window_ms",
           "avg(arrival_rate_per_s) AS arrival_rate_per_s",
           "avg(size) AS mean_batch_size",
           "avg(effective_cap) AS effective_cap",
       ), BATCH_ROWS)),
    _q("compute_by_batch_size", "Per-batch compute time by batch size", "table",
       "t(b): compute p50/p99 per batch size and per request; the cost curve the engine learns.",
       per_model("size", (
           "count() AS batches",
           "quantileExactInclusive(0.5)(compute_ms) AS compute_p50_ms",
           "quantileExactInclusive(0.99)(compute_ms) AS compute_p99_ms",
           "quantileExactInclusive(0.5)(compute_ms / size) AS ms_per_request_p50",
       ), BATCH_ROWS)),
    _q("compute_over_time", "Compute per request over time (a heavier model shows here)", "time_series",
       "Batch sizes flat while ms per request rises = the backend got slower, not the window.",
       per_bucket("dispatch_time", (
           "avg(size) AS mean_batch_size",
           "quantileExactInclusive(0.5)(compute_ms) AS compute_p50_ms",
           "quantileExactInclusive(0.5)(compute_ms / size) AS ms_per_request_p50",
       ), BATCH_ROWS)),
    _q("latency_quantiles_rollup", "p50 / p99 / p999 from the per-minute rollup", "time_series",
       "Long ranges at low cost: merged quantileTiming states (nearest rank, 1 ms resolution below 1 s, capped at 30 s).",
       quantile_series(
           "minute", "sum(requests)",
           "quantilesTimingMerge(0.5, 0.99, 0.999)(e2e_ms_q) AS e2e",
           "quantilesTimingMerge(0.5, 0.99, 0.999)(wait_ms_q) AS wait",
           f"FROM latency_minute\nWHERE $__timeFilter(minute) AND {MODEL_FILTER}",
       )),
    _q("batch_sizes_rollup", "Batch size distribution from the per-minute rollup", "table",
       "Exact counts (sums of per-minute counts) at any range.",
       per_model("size", ("sum(batches) AS batch_count", share_of_model("batch_count")),
                 f"FROM batches_minute\nWHERE $__timeFilter(minute) AND {MODEL_FILTER}")),
]  # fmt: skip

LATEST_PER_PARTITION = f"""
    SELECT $__timeInterval(ts) AS time, model, topic, partition,
           argMax(lag, ts) AS lag, argMax(lag_age_ms, ts) AS lag_age_ms
    FROM consumer_lag FINAL
    WHERE $__timeFilter(ts) AND partition >= 0 AND model != '' AND {MODEL_FILTER}
    GROUP BY time, model, topic, partition"""
"""Each partition's last sample per bucket, from a consumer or from the sink's broker-side sampler
(whichever is newer): a partition sampled twice counts once, lag sums over partitions (Burrow's
per-group total), and a model with no consumer left still has its lag. The dead-letter topic's rows
(model '') are not lag."""

_LAG = [
    _q("lag_over_time", "Consumer lag and lag age over time", "time_series",
       "Records not yet answered (end offset - committed offset, summed over partitions) and the age "
       "of the oldest of them (max over partitions), per bucket.",
       f"""
SELECT time, model, sum(lag) AS lag, max(lag_age_ms) AS lag_age_ms
FROM ({LATEST_PER_PARTITION})
GROUP BY time, model
ORDER BY time, model
"""),
    _q("engine_state", "Engine state reported by the consumers", "time_series",
       "Per bucket, the mean over consumer samples of the window, the learned cap, the engine queue and the marked share.",
       f"""
SELECT
    $__timeInterval(ts) AS time,
    model,
    avg(window_ms) AS window_ms,
    avg(effective_cap) AS effective_cap,
    avg(queue) AS queue,
    avg(marked_share) AS marked_share
FROM (
    SELECT ts, model, consumer_id, any(window_ms) AS window_ms, any(effective_cap) AS effective_cap,
           any(queue) AS queue, any(marked_share) AS marked_share
    FROM consumer_lag FINAL
    WHERE $__timeFilter(ts) AND source = 'consumer' AND {MODEL_FILTER}
    GROUP BY ts, model, consumer_id
)
GROUP BY time, model
ORDER BY time, model
"""),
    _q("lag_summary", "Consumer lag per model", "table",
       "Lag and lag age in the last bucket of the range, their maxima over the range, and how many consumers reported.",
       f"""
SELECT
    b.model AS model,
    argMax(b.lag, b.time) AS lag_now,
    argMax(b.lag_age_ms, b.time) AS lag_age_now_ms,
    max(b.lag) AS lag_max,
    max(b.lag_age_ms) AS lag_age_max_ms,
    any(c.consumers) AS consumers
FROM (
    SELECT time, model, sum(lag) AS lag, max(lag_age_ms) AS lag_age_ms
    FROM ({LATEST_PER_PARTITION})
    GROUP BY time, model
) AS b
LEFT JOIN (
    SELECT model, uniqExact(consumer_id) AS consumers
    FROM consumer_lag
    WHERE $__timeFilter(ts) AND source = 'consumer' AND {MODEL_FILTER}
    GROUP BY model
) AS c ON c.model = b.model
GROUP BY b.model
ORDER BY model
"""),
]  # fmt: skip

_CONSUMERS = [
    _q("consumers", "By consumer: requests, share, latency, throughput, batch size, capacity", "table",
       "One row per consumer of the model: requests it ran and its share of the model's, e2e p50 / p99, req/s over "
       "its span with data, mean batch size, its latest measured capacity (null: not measured yet) and its not-ok "
       "share (refusals included). One slow device shows here as one row with a high p99 and a large mean batch.",
       f"""
SELECT
    l.consumer_id AS consumer_id,
    l.model AS model,
    l.requests AS requests,
    l.requests / sum(l.requests) OVER (PARTITION BY l.model) AS share,
    l.e2e_p50_ms AS e2e_p50_ms,
    l.e2e_p99_ms AS e2e_p99_ms,
    l.requests_per_s AS requests_per_s,
    b.mean_batch_size AS mean_batch_size,
    nullIf(c.latest_capacity, 0) AS capacity_per_s,
    l.not_ok_share AS not_ok_share
FROM (
    SELECT
        model, consumer_id,
        countIf({SERVED}) AS requests,
        requests / {DATA_SPAN_S} AS requests_per_s,
        quantilesExactInclusiveIf(0.5, 0.99)(e2e_ms, {SERVED}) AS e2e,
        e2e[1] AS e2e_p50_ms, e2e[2] AS e2e_p99_ms,
        countIf(outcome != 'ok') / count() AS not_ok_share
    {OUTCOME_ROWS.replace(chr(10), chr(10) + "    ")}
    GROUP BY model, consumer_id
) AS l
LEFT JOIN (
    SELECT model, consumer_id, avg(size) AS mean_batch_size
    {BATCH_ROWS.replace(chr(10), chr(10) + "    ")}
    GROUP BY model, consumer_id
) AS b ON b.model = l.model AND b.consumer_id = l.consumer_id
LEFT JOIN (
    SELECT model, consumer_id, argMax(capacity_per_s, ts) AS latest_capacity
    FROM consumer_lag FINAL
    WHERE $__timeFilter(ts) AND capacity_per_s > 0 AND source = 'consumer' AND {MODEL_FILTER}
    GROUP BY model, consumer_id
) AS c ON c.model = l.model AND c.consumer_id = l.consumer_id
ORDER BY model, consumer_id
"""),
    _q("consumer_latency", "e2e p99 by consumer over time", "time_series",
       "Exact e2e p99 and requests/s per bucket and consumer of the model: the p99 line "
       "far above the others is the device that holds the group's tail.",
       f"""
SELECT
    $__timeInterval(enqueue_time) AS time,
    model,
    consumer_id,
    quantileExactInclusive(0.99)(e2e_ms) AS e2e_p99_ms,
    count() / $__interval_s AS requests_per_s
{LATENCY_ROWS}
GROUP BY time, model, consumer_id
ORDER BY time, model, consumer_id
"""),
]  # fmt: skip

SLO = _q(
    "slo",
    "Requests within their SLO",
    "table",
    "Share of requests (refusals included, as misses) answered ok within slo_p99_ms + tokens_out x slo_ms_per_new_token of their model, and "
    "the p99 of e2e over that SLO (<= 1: the objective held). Report only: the objectives come from the config "
    "as bound arrays, and tokens_out (what was generated) stands for the requested max_new_tokens, which "
    "judges a request that stopped early by EOS against the tighter SLO.",
    f"""
SELECT
    model,
    count() AS requests,
    any(slo_base_ms) AS slo_p99_ms,
    any(slo_token_ms) AS slo_ms_per_new_token,
    countIf(outcome = 'ok' AND e2e_ms <= slo_ms) / count() AS within_slo_share,
    quantileExactInclusive(0.99)(if(outcome = 'ok', e2e_ms / slo_ms, inf)) AS p99_over_slo
FROM (
    SELECT
        model, outcome, e2e_ms,
        transform(model, {{slo_models:Array(String)}}, {{slo_base:Array(Float64)}}, {{slo_default:Float64}}) AS slo_base_ms,
        transform(model, {{slo_models:Array(String)}}, {{slo_per_token:Array(Float64)}}, 0.) AS slo_token_ms,
        slo_base_ms + tokens_out * slo_token_ms AS slo_ms
    {OUTCOME_ROWS.replace(chr(10), chr(10) + "    ")}
)
GROUP BY model
ORDER BY model
""",
)
"""Not a board panel (Grafana has no config to bind); `batchtide report` runs it with the config's objectives."""

QUERIES: dict[str, AnalysisQuery] = {q.name: q for q in _ALL + _LAG + _CONSUMERS}
REPORT_QUERIES = (
    "summary", "not_ok_reasons", "consumers", "warmup", "generation", "latency_quantiles", "throughput", "batch_sizes", "target_hit_ratio",
    "dispatch_reasons", "device_memory", "compute_by_batch_size", "window_over_time",
    "lag_summary", "lag_over_time",
)  # fmt: skip
