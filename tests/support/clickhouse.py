"""Fixtures: clickhouse (filled in by its issue)."""
