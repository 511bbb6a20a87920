"""Result lines for a person: the payload condensed, the reason shown, nothing lost in --json."""

from __future__ import annotations

import json

from pipeline.tools.views.answer_lines import Answer


def _answer(record: dict, timestamp_ms: int = 2_000) -> Answer:
    return Answer.decode(json.dumps(record).encode(), timestamp_ms)


def test_embedding_shows_dimension_and_norm_and_json_keeps_it() -> None:
    vector = [3.0, 4.0] + [0.0] * 382
    answer = _answer({"id": "r-1", "model": "m", "outcome": "ok", "embedding": vector, "batch_id": 7,
                      "consumer_id": "c-1", "enqueue_ms": 1_960})  # fmt: skip
    line = answer.as_line()
    assert "r-1" in line and "ok" in line and "40 ms" in line and "batch 7" in line and "c-1" in line
    assert line.endswith("embedding dim 384 norm 5.000") and len(line) < 120
    full = json.loads(answer.as_json())
    assert full["embedding"] == vector and full["e2e_ms"] == 40


def test_generated_text_is_cut_to_a_preview() -> None:
    text = "Once upon a time\nthere was a consumer group that never fell behind, the end."
    line = _answer({"id": "g", "model": "m", "outcome": "ok", "text": text, "token_ids": [1, 2, 3]}).as_line()
    preview = line.split("text ", 1)[1]
    assert preview.startswith('"Once upon a time there was') and preview.endswith('…"')
    assert len(json.loads(preview)) == 40 and "\n" not in line


def test_errors_and_rejections_show_their_reason() -> None:
    reason = "schema: exactly one of `text` and `token_ids` must be set"
    line = _answer({"id": "bad", "model": "m", "outcome": "rejected", "error": reason, "enqueue_ms": 1_999}).as_line()
    assert "rejected" in line and "no batch" in line and line.endswith(f"reason: {reason}")
    expired = _answer({"id": "late", "model": "m", "outcome": "expired"}).as_line()
    assert "reason: no reason given" in expired and "- ms" in expired


def test_undecodable_records_are_shown_not_fatal() -> None:
    answer = Answer.decode(b"\xff\xfe not json", 1_000)
    assert answer.id is None and "undecodable" in answer.as_line() and "undecodable" in json.loads(answer.as_json())
