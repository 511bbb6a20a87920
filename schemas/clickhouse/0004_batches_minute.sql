-- Per-minute batch-size counts (and dispatch reasons, target hits, compute
-- time per size) from batches, fed by a materialized view; same replay
-- guarantee as latency_minute.
CREATE TABLE IF NOT EXISTS ${db}.batches_minute${local} ${on_cluster}
(
    model        LowCardinality(String),
    minute       DateTime('UTC'),
    size         UInt32,
    reason       LowCardinality(String),
    batches      SimpleAggregateFunction(sum, UInt64),
    hits         SimpleAggregateFunction(sum, UInt64),
    marked       SimpleAggregateFunction(sum, UInt64),
    compute_ms_q AggregateFunction(quantilesTiming(0.5, 0.99), Float64)
)
ENGINE = ${engine:AggregatingMergeTree}
PARTITION BY toYYYYMM(minute)
ORDER BY (model, minute, size, reason)
TTL minute + INTERVAL ${rollup_ttl_days} DAY;

CREATE MATERIALIZED VIEW IF NOT EXISTS ${db}.batches_minute_mv${local} ${on_cluster}
TO ${db}.batches_minute${local}
AS SELECT
    model,
    toStartOfMinute(dispatch_time) AS minute,
    size,
    reason,
    count() AS batches,
    countIf(hit_target) AS hits,
    sum(toUInt64(marked_count)) AS marked,
    quantilesTimingState(0.5, 0.99)(compute_ms) AS compute_ms_q
FROM ${db}.batches${local}
GROUP BY model, minute, size, reason;

${distributed:batches_minute:cityHash64(model, minute)};
