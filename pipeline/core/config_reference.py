"""The configuration reference, rendered from the typed config itself.

Defaults and their explanations live once, in `pipeline/core/config.py` (each
field's docstring); the tables in docs/configuration.md are generated from there
(`batchtide config reference --write docs/configuration.md`) and a test keeps the
two identical.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
from typing import Any

from pipeline.core import config

TABLES: tuple[tuple[str, type, str], ...] = (
    ("[defaults] / [models.NAME]", config.BatchProfile, "batching profile; every knob is per model"),
    ("[models.NAME]", config.ModelConfig, "what runs the model"),
    ("[kafka]", config.KafkaSettings, "broker connection and topics"),
    ("[clickhouse]", config.ClickHouseSettings, "latency store and sink"),
    ("[consumer]", config.ConsumerSettings, "fetch loop"),
    ("[alerts]", config.AlertSettings, "Grafana alert rules (`batchtide dashboards generate --config F`)"),
)


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings: the string literal right after each annotated field."""
    tree = ast.parse(inspect.getsource(cls))
    class_def = tree.body[0]
    if not isinstance(class_def, ast.ClassDef):
        raise TypeError(f"{cls.__name__}: its source does not start with a class definition")
    body = class_def.body
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    else:
        return "—"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[]" if not value else str(list(value))
    return str(value)


def reference_markdown() -> str:
    lines: list[str] = []
    for table, cls, what in TABLES:
        lines += [f"**{table}** — {what}", "", "| key | default | meaning |", "|---|---|---|"]
        docs = _field_docs(cls)
        for field in dataclasses.fields(cls):
            if field.name in ("name", "profile"):
                continue
            meaning = docs.get(field.name, "").replace("|", "\\|")
            lines.append(f"| `{field.name}` | `{_default(field)}` | {meaning} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


START = "<!-- config-reference:start -->\n"
END = "<!-- config-reference:end -->"


def marked_region(text: str) -> tuple[int, int]:
    """Where the generated reference sits in a document: between the two markers."""
    start = text.index(START) + len(START)
    return start, text.index(END, start)


def write_into(path: str) -> bool:
    """Replace the marked region of the document at `path` with the reference; True if it changed."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start, end = marked_region(text)
    updated = text[:start] + reference_markdown() + text[end:]
    if updated != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(updated)
    return updated != text
