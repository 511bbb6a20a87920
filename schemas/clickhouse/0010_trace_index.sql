-- A request replayed from a trace file (`batchtide produce --trace`) records its
-- index in the trace (LatencyEvent.trace_index, the file's 0-based data row), so a
-- live answer can be set beside the same request simulated; -1 for any other
-- request and for rows stored before this column.
-- As in 0005, the second statement of the pair reaches the Distributed table
-- of a cluster layout and is a no-op on a single node.
ALTER TABLE ${db}.request_latency${local} ${on_cluster} ADD COLUMN IF NOT EXISTS trace_index Int32 DEFAULT -1 AFTER reason;
ALTER TABLE ${db}.request_latency ${on_cluster} ADD COLUMN IF NOT EXISTS trace_index Int32 DEFAULT -1 AFTER reason;
