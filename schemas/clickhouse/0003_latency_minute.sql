-- Per-minute rollup of request_latency for dashboards over long ranges.
-- Fed by a materialized view at insert time, so it counts what was inserted:
-- the sink drops already-stored request ids before inserting (see
-- docs/clickhouse.md), which keeps these counts exact for at-least-once replays.
-- Quantiles are quantileTiming states: mergeable across minutes; 1 ms resolution
-- below 1024 ms, 16 ms above, values over 30 s count as 30 s (exact figures: raw table).
CREATE TABLE IF NOT EXISTS ${db}.latency_minute${local} ${on_cluster}
(
    model           LowCardinality(String),
    minute          DateTime('UTC'),
    requests        SimpleAggregateFunction(sum, UInt64),
    marked          SimpleAggregateFunction(sum, UInt64),
    waits_over_1s   SimpleAggregateFunction(sum, UInt64),
    tokens_in_sum   SimpleAggregateFunction(sum, UInt64),
    tokens_out_sum  SimpleAggregateFunction(sum, UInt64),
    e2e_ms_q        AggregateFunction(quantilesTiming(0.5, 0.99, 0.999), Float64),
    wait_ms_q       AggregateFunction(quantilesTiming(0.5, 0.99, 0.999), Float64),
    compute_ms_q    AggregateFunction(quantilesTiming(0.5, 0.99, 0.999), Float64),
    device_mem_max  SimpleAggregateFunction(max, UInt64)
)
ENGINE = ${engine:AggregatingMergeTree}
PARTITION BY toYYYYMM(minute)
ORDER BY (model, minute)
TTL minute + INTERVAL ${rollup_ttl_days} DAY;

CREATE MATERIALIZED VIEW IF NOT EXISTS ${db}.latency_minute_mv${local} ${on_cluster}
TO ${db}.latency_minute${local}
AS SELECT
    model,
    toStartOfMinute(enqueue_time) AS minute,
    count() AS requests,
    countIf(tail_marked) AS marked,
    countIf(wait_ms > 1000) AS waits_over_1s,
    sum(toUInt64(tokens_in)) AS tokens_in_sum,
    sum(toUInt64(tokens_out)) AS tokens_out_sum,
    quantilesTimingState(0.5, 0.99, 0.999)(e2e_ms) AS e2e_ms_q,
    quantilesTimingState(0.5, 0.99, 0.999)(wait_ms) AS wait_ms_q,
    quantilesTimingState(0.5, 0.99, 0.999)(compute_ms) AS compute_ms_q,
    max(device_mem_bytes) AS device_mem_max
FROM ${db}.request_latency${local}
GROUP BY model, minute;

${distributed:latency_minute:cityHash64(model, minute)};
