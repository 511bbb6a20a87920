"""What the consumers stand on: typed config, the pure batching engine, the simulator,
the Kafka plumbing and the ClickHouse store.

Nothing here imports `consumers` or the rest of `pipeline` (views, benches, chaos, dev tools,
commands), which sit above the consumers; `tests/test_layers.py` holds that line.
"""
