-- Why a request was not answered `ok` (LatencyEvent.reason: a rejection's
-- reason, `runner_error`, `deadline`, ...), so refusals count wherever
-- outcomes do; and each consumer's measured capacity in its lag samples
-- (LagEvent.capacity_per_s), so the group's balance can be seen per member.
-- As in 0005, the second statement of each pair reaches the Distributed table
-- of a cluster layout and is a no-op on a single node.
ALTER TABLE ${db}.request_latency${local} ${on_cluster} ADD COLUMN IF NOT EXISTS reason LowCardinality(String) DEFAULT '' AFTER last_token_time;
ALTER TABLE ${db}.request_latency ${on_cluster} ADD COLUMN IF NOT EXISTS reason LowCardinality(String) DEFAULT '' AFTER last_token_time;
ALTER TABLE ${db}.consumer_lag${local} ${on_cluster} ADD COLUMN IF NOT EXISTS capacity_per_s Float64 DEFAULT 0 AFTER dead_letters;
ALTER TABLE ${db}.consumer_lag ${on_cluster} ADD COLUMN IF NOT EXISTS capacity_per_s Float64 DEFAULT 0 AFTER dead_letters;
