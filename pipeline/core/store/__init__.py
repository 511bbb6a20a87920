"""The latency store (ClickHouse): client, schema migrations, event writer, loader, analysis SQL.

Data flow: sink.py -> store/loader.py (batching, retries, acks) -> store/writer.py
(dedupe, insert) -> schemas/clickhouse/*.sql (tables, rollups) -> store/queries.py
(the one place for analysis SQL) -> store/macros.py (Grafana macro expansion) -> report.py.
See docs/clickhouse.md.
"""
