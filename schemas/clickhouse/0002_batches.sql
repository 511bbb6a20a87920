-- One row per dispatched batch (schemas.messages.BatchEvent, DESIGN 4.7).
-- Batch ids are per consumer: (consumer_id, batch_id) is the identity, and it
-- is part of the sorting key, so ReplacingMergeTree collapses re-deliveries.
CREATE TABLE IF NOT EXISTS ${db}.batches${local} ${on_cluster}
(
    batch_id           UInt64,
    model              LowCardinality(String),
    consumer_id        LowCardinality(String),
    dispatch_time      DateTime64(3, 'UTC'),
    size               UInt32,
    cost               UInt32,
    reason             LowCardinality(String),
    window_ms          Float64,
    hit_target         Bool,
    target_size        UInt32,
    marked_count       UInt32,
    oldest_wait_ms     Float64,
    queue_depth        UInt32,
    effective_cap      UInt32,
    cap_reason         LowCardinality(String),
    arrival_rate_per_s Float64,
    compute_ms         Float64,
    tokens_in          UInt32,
    tokens_out         UInt32,
    device_mem_bytes   UInt64,
    device_mem_kind    LowCardinality(String),
    schema_version     UInt16,
    inserted_at        DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ${engine:ReplacingMergeTree}
PARTITION BY toDate(dispatch_time)
ORDER BY (model, dispatch_time, consumer_id, batch_id)
TTL toDateTime(dispatch_time) + INTERVAL ${ttl_days} DAY;

${distributed:batches:cityHash64(consumer_id, batch_id)};
