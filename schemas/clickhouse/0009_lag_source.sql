-- Lag sampled from outside the consumers: the sink reads every model's
-- consumer group from the broker (pipeline/core/store/group_lag.py) and writes
-- rows with source = 'broker', consumer_id = '' and the group's member count,
-- whether or not any consumer runs. A consumer's own samples keep
-- source = 'consumer' (and members = 0). The dead-letter topic's end offsets
-- are sampled the same way, in rows with model = '' and lag = 0.
-- As in 0005, the second statement of each pair reaches the Distributed table
-- of a cluster layout and is a no-op on a single node.
ALTER TABLE ${db}.consumer_lag${local} ${on_cluster} ADD COLUMN IF NOT EXISTS source LowCardinality(String) DEFAULT 'consumer' AFTER capacity_per_s;
ALTER TABLE ${db}.consumer_lag ${on_cluster} ADD COLUMN IF NOT EXISTS source LowCardinality(String) DEFAULT 'consumer' AFTER capacity_per_s;
ALTER TABLE ${db}.consumer_lag${local} ${on_cluster} ADD COLUMN IF NOT EXISTS members UInt32 DEFAULT 0 AFTER source;
ALTER TABLE ${db}.consumer_lag ${on_cluster} ADD COLUMN IF NOT EXISTS members UInt32 DEFAULT 0 AFTER source;
