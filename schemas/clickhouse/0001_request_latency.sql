-- One row per answered request (schemas.messages.LatencyEvent).
-- ReplacingMergeTree keyed by the sorting key: a re-delivered event has the same
-- (model, enqueue_time, request_id) -- enqueue_time is the request record's
-- Kafka CreateTime, which no replay changes -- so merges keep one row per request.
CREATE TABLE IF NOT EXISTS ${db}.request_latency${local} ${on_cluster}
(
    request_id         String,
    model              LowCardinality(String),
    consumer_id        LowCardinality(String),
    outcome            LowCardinality(String),
    enqueue_time       DateTime64(3, 'UTC'),
    fetch_time         DateTime64(3, 'UTC'),
    dispatch_time      DateTime64(3, 'UTC'),
    compute_start_time DateTime64(3, 'UTC'),
    compute_end_time   DateTime64(3, 'UTC'),
    produce_time       DateTime64(3, 'UTC'),
    wait_ms            Float64,
    compute_ms         Float64,
    e2e_ms             Float64,
    batch_id           UInt64,
    batch_size         UInt32,
    tail_marked        Bool,
    priority           UInt8,
    tokens_in          UInt32,
    tokens_out         UInt32,
    device_mem_bytes   UInt64,
    device_mem_kind    LowCardinality(String),
    kafka_partition    UInt32,
    kafka_offset       UInt64,
    forwarded          Bool,
    schema_version     UInt16,
    inserted_at        DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ${engine:ReplacingMergeTree}
PARTITION BY toDate(enqueue_time)
ORDER BY (model, enqueue_time, request_id)
TTL toDateTime(enqueue_time) + INTERVAL ${ttl_days} DAY;

${distributed:request_latency:cityHash64(request_id)};
