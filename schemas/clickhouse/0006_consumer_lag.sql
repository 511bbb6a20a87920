-- One row per consumer, partition and lag sample (schemas.messages.LagEvent,
-- one event per consumer every [consumer] lag_interval_ms; consumers/lag.py).
-- lag = end offset - committed offset; lag_age_ms = age of the oldest record
-- not yet answered (the one at the committed offset) when the sample was taken.
-- The engine's state and the consumer's counters repeat on each partition row
-- (a consumer without partitions still reports its state in a row with
-- partition = -1 and topic '').
CREATE TABLE IF NOT EXISTS ${db}.consumer_lag${local} ${on_cluster}
(
    ts                 DateTime64(3, 'UTC'),
    model              LowCardinality(String),
    consumer_id        LowCardinality(String),
    topic              LowCardinality(String),
    partition          Int32,
    end_offset         Int64,
    committed_offset   Int64,
    lag                Int64,
    oldest_time        DateTime64(3, 'UTC'),
    lag_age_ms         Float64,
    queue              UInt32,
    inflight           UInt32,
    window_ms          Float64,
    effective_cap      UInt32,
    cap_reason         LowCardinality(String),
    marked_share       Float64,
    arrival_rate_per_s Float64,
    batches            UInt64,
    last_batch_time    DateTime64(3, 'UTC'),
    dead_letters       UInt64,
    schema_version     UInt16,
    inserted_at        DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ${engine:ReplacingMergeTree}
PARTITION BY toDate(ts)
ORDER BY (model, ts, consumer_id, topic, partition)
TTL toDateTime(ts) + INTERVAL ${ttl_days} DAY;

${distributed:consumer_lag:cityHash64(consumer_id)};
