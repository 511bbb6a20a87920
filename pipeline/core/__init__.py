"""What the consumers stand on: typed config, the pure batching engine, the simulator,
the Kafka plumbing and the ClickHouse store.

Nothing here imports the processes (`consumers`, `pipeline/sink/`) or the tools above them
(`pipeline/tools/`); `tests/test_layers.py` holds that line.
"""
