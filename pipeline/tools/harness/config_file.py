"""The config file a harness-started process reads: batchtide's flat TOML tables, written from dicts."""

from __future__ import annotations

from typing import Any

from pipeline.core.config import KafkaSettings


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {value!r} to TOML")


def toml_text(tables: dict[str, dict[str, Any]]) -> str:
    """A config file from {table: {key: scalar}}; keys whose value is None are left out."""
    lines: list[str] = []
    for table, values in tables.items():
        lines.append(f"[{table}]")
        lines.extend(f"{key} = {_toml_value(v)}" for key, v in values.items() if v is not None)
        lines.append("")
    return "\n".join(lines)


def kafka_table(settings: KafkaSettings, **extra: Any) -> dict[str, Any]:
    """The [kafka] table that points a process at `settings`' broker and topic prefix."""
    return {"bootstrap_servers": settings.bootstrap_servers, "topic_prefix": settings.topic_prefix, **extra}
