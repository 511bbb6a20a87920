"""The latency store (ClickHouse): connection, schema migrations, event writers, analysis SQL.

Data flow: the sink (pipeline/sink/: app.py -> loader.py, batching, retries, acks) -> store/writer.py
(dedupe, insert) -> schemas/clickhouse/*.sql (tables, rollups) -> store/queries.py
(the one place for analysis SQL) -> store/macros.py (Grafana macro expansion) -> report.py.
See docs/clickhouse.md.
"""
