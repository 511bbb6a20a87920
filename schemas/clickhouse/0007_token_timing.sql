-- Generation's per-token timing (LatencyEvent.first_token_ms / last_token_ms):
-- when a request's first and last tokens were decoded. Time to first token is
-- first_token_time - enqueue_time; time per output token is
-- (last_token_time - first_token_time) / (tokens_out - 1). Both are the epoch
-- (0) for models that do not generate and for rows stored before this column.
-- As in 0005, the second statement of each pair reaches the Distributed table
-- of a cluster layout and is a no-op on a single node.
ALTER TABLE ${db}.request_latency${local} ${on_cluster} ADD COLUMN IF NOT EXISTS first_token_time DateTime64(3, 'UTC') DEFAULT 0 AFTER warmup;
ALTER TABLE ${db}.request_latency ${on_cluster} ADD COLUMN IF NOT EXISTS first_token_time DateTime64(3, 'UTC') DEFAULT 0 AFTER warmup;
ALTER TABLE ${db}.request_latency${local} ${on_cluster} ADD COLUMN IF NOT EXISTS last_token_time DateTime64(3, 'UTC') DEFAULT 0 AFTER first_token_time;
ALTER TABLE ${db}.request_latency ${on_cluster} ADD COLUMN IF NOT EXISTS last_token_time DateTime64(3, 'UTC') DEFAULT 0 AFTER first_token_time;
