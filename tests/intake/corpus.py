"""The hostile-payload corpus in tests/fuzz_corpus/, loaded for replay.

Each case is one Kafka record (value + headers) with the DeadLetter reason it
must produce, or `ok` when it must be answered. The intake tests replay the
`intake` stage through `decode_request`; the consumer's end-to-end DLQ test
replays every case through the real broker (`from tests.intake.corpus import
load_corpus`).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

CORPUS_DIR = Path(__file__).resolve().parent.parent / "fuzz_corpus"
Stage = Literal["intake", "runner", "loop", "served"]


@dataclass(frozen=True)
class Case:
    name: str
    value: bytes | None
    """Record value; None for a tombstone (null value)."""
    expect: str
    """A Rejection reason code, or `ok`."""
    stage: Stage
    note: str
    headers: list[tuple[str, bytes]] = field(default_factory=list)


@dataclass(frozen=True)
class Corpus:
    model: str
    """Name of the model the cases are addressed to (the topic's model)."""
    max_message_bytes: int
    max_input_tokens: int
    poison_marker: str
    cases: list[Case]


def _case(raw: dict[str, Any]) -> Case:
    value = (CORPUS_DIR / raw["file"]).read_bytes() if raw["file"] else None
    headers = [(h["key"], base64.b64decode(h["value_b64"])) for h in raw.get("headers", [])]
    return Case(raw["name"], value, raw["expect"], raw["stage"], raw["note"], headers)


def load_corpus() -> Corpus:
    index = json.loads((CORPUS_DIR / "index.json").read_text())
    return Corpus(
        model=index["model"],
        max_message_bytes=index["max_message_bytes"],
        max_input_tokens=index["max_input_tokens"],
        poison_marker=index["poison_marker"],
        cases=[_case(c) for c in index["cases"]],
    )
