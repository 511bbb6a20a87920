-- Warm-up requests (Request.warmup, carried to LatencyEvent.warmup) are answered
-- and stored like any other, but the analysis queries leave them out of the
-- latency figures and count them apart. The second statement reaches the
-- Distributed table of a cluster layout; on a single node it names the same
-- table and IF NOT EXISTS makes it a no-op.
ALTER TABLE ${db}.request_latency${local} ${on_cluster} ADD COLUMN IF NOT EXISTS warmup Bool DEFAULT false AFTER forwarded;
ALTER TABLE ${db}.request_latency ${on_cluster} ADD COLUMN IF NOT EXISTS warmup Bool DEFAULT false AFTER forwarded;
