"""Result records as a person reads them: one short line per answer.

`batchtide results` prints these by default. A raw result holds a whole
embedding (384 floats for MiniLM, ~5 KB of JSON), which nobody can read in a
terminal; the line keeps what an operator looks for (which request, how it
ended, how long it took, which batch and consumer) and condenses the payload
into a preview: the start of generated text, an embedding's dimension and
norm, or the reason of an error or rejection. `--json` prints the full record.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

TEXT_PREVIEW_CHARS = 40
REASON_CHARS = 80
ID_WIDTH = 16


@dataclass(frozen=True)
class Answer:
    """One decoded result record with its end-to-end time (record time minus enqueue time)."""

    record: dict[str, Any] | None
    timestamp_ms: int
    raw: bytes

    @classmethod
    def decode(cls, value: bytes | None, timestamp_ms: int) -> Answer:
        raw = value or b""
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        return cls(record if isinstance(record, dict) else None, timestamp_ms, raw)

    @property
    def id(self) -> str | None:
        return str(self.record.get("id")) if self.record and "id" in self.record else None

    @property
    def e2e_ms(self) -> int | None:
        if not self.record or not self.record.get("enqueue_ms"):
            return None
        end = self.timestamp_ms or self.record.get("done_ms") or 0
        return int(end - self.record["enqueue_ms"])

    def as_json(self) -> str:
        """The full record plus `e2e_ms`, as one JSON line."""
        if self.record is None:
            return json.dumps({"undecodable": self.raw[:80].decode("utf-8", "replace")})
        full = dict(self.record)
        if self.e2e_ms is not None:
            full["e2e_ms"] = self.e2e_ms
        return json.dumps(full)

    def as_line(self) -> str:
        """`time  id  outcome  e2e  batch  consumer  preview`, fixed columns where short."""
        when = datetime.fromtimestamp(self.timestamp_ms / 1000, tz=UTC).strftime("%H:%M:%S.%f")[:-3]
        if self.record is None:
            return f"{when}  (undecodable record: {self.raw[:60]!r})"
        r = self.record
        e2e = f"{self.e2e_ms:>6} ms" if self.e2e_ms is not None else "     - ms"
        batch = f"batch {r['batch_id']}" if r.get("batch_id") is not None else "no batch"
        return (
            f"{when}  {r.get('id', '?')!s:<{ID_WIDTH}}  {r.get('outcome', '?')!s:<8}  {e2e}  "
            f"{batch:<11}  {r.get('consumer_id') or '-'}  {preview(r)}"
        )


def preview(record: dict[str, Any]) -> str:
    """The payload in a few characters: reason, generated text, or embedding shape."""
    if record.get("outcome") != "ok":
        reason = str(record.get("error") or "no reason given")
        return "reason: " + _clip(reason, REASON_CHARS)
    parts = []
    text = record.get("text")
    if isinstance(text, str):
        parts.append("text " + json.dumps(_clip(text, TEXT_PREVIEW_CHARS), ensure_ascii=False))
    embedding = record.get("embedding")
    if isinstance(embedding, list):
        norm = math.sqrt(sum(float(x) * float(x) for x in embedding))
        parts.append(f"embedding dim {len(embedding)} norm {norm:.3f}")
    tokens = record.get("token_ids")
    if isinstance(tokens, list) and not isinstance(text, str):
        parts.append(f"{len(tokens)} token ids")
    return ", ".join(parts) or "empty answer"


def _clip(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
