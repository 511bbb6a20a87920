"""decode_request, parse_forward_headers and RecentIds on representative hostile input,
and the whole fuzz corpus replayed through intake and a simulated runner."""

from __future__ import annotations

import pytest

from consumers.intake import (
    MAX_DETAIL_CHARS,
    REASONS,
    RecentIds,
    Rejection,
    check_reply_topic,
    decode_request,
    parse_forward_headers,
    refused,
)
from consumers.runners import make_runner, run_isolating
from pipeline.core.config import ModelConfig
from schemas.messages import Request

from .corpus import load_corpus

MODEL = "m1"
LIMIT = 4096


def decode(value: bytes | None) -> Request | Rejection:
    return decode_request(value, model=MODEL, max_bytes=LIMIT)


def rejected(value: bytes | None) -> Rejection:
    result = decode(value)
    assert isinstance(result, Rejection), result
    assert 0 < len(result.detail) <= MAX_DETAIL_CHARS
    return result


def test_valid_request_decodes() -> None:
    req = decode(b'{"id":"a1","model":"m1","text":"hi","priority":0,"reply_topic":"my.replies"}')
    assert isinstance(req, Request)
    assert (req.id, req.text, req.priority, req.reply_topic) == ("a1", "hi", 0, "my.replies")


@pytest.mark.parametrize(
    ("value", "reason", "detail_part"),
    [
        (None, "empty", "null"),
        (b"", "empty", "empty"),
        (b'{"id":"a","model":"m1","text":"' + b"x" * LIMIT + b'"}', "oversize", "limit is 4096"),
        (b'{"id":"a","model":"m1","text":"caf\xe9"}', "not_utf8", "invalid UTF-8 at byte"),
        (b"\xff\xfe{}", "not_utf8", "byte 0"),
        (b'{"id":"a","model":"m1","te', "invalid_json", "truncated"),
        (b'{"id":"a","model":"m1","text":"x"} tail', "invalid_json", "trailing characters"),
        (b'{"id":"a","model":"m1","text":"x","priority":12}', "schema", "priority: Expected `int` <= 9, got 12"),
        (b'{"id":"a","model":"m1","text":"x","deadline_ms":-1}', "schema", "deadline_ms"),
        (b'{"id":"a","model":"m1"}', "schema", "exactly one of `text` and `token_ids`"),
        (b'{"id":"a","model":"m1","text":"x","token_ids":[1]}', "schema", "exactly one"),
        (b'{"id":"a","model":"m1","text":"x","extra":1}', "schema", "unknown field `extra`"),
        (b'{"id":"a","model":"m1","token_ids":[1,"2"]}', "schema", "token_ids[1]: Expected `int`, got `str` ('2')"),
        (b'{"id":"a","model":"m1","text":"x","reply_topic":"replies\\n"}', "schema", "reply_topic: must be letters"),
        (b'{"id":"a","model":"m2","text":"x"}', "model_mismatch", "'m2' but this topic serves 'm1'"),
        (b'{"id":"a","model":"m1\\n","text":"x"}', "model_mismatch", "'m1\\n' but this topic serves 'm1'"),
    ],
)
def test_each_reason_has_a_precise_detail(value: bytes | None, reason: str, detail_part: str) -> None:
    rejection = rejected(value)
    assert rejection.reason == reason
    assert detail_part in rejection.detail


def test_rejection_keeps_address_when_known() -> None:
    r = rejected(b'{"id":"req-7","model":"m1","text":"x","priority":99,"reply_topic":"client.replies"}')
    assert (r.request_id, r.reply_topic) == ("req-7", "client.replies")
    r = rejected(b'{"id":"req-8","model":"other","text":"x","reply_topic":"client.replies"}')
    assert (r.reason, r.request_id, r.reply_topic) == ("model_mismatch", "req-8", "client.replies")


def test_rejection_drops_an_address_that_is_itself_invalid() -> None:
    r = rejected(b'{"id":42,"model":"m1","text":"x","reply_topic":"bad topic!"}')
    assert r.request_id is None and r.reply_topic is None
    r = rejected(b'{"id":"' + b"i" * 200 + b'","model":"m1","text":"x"}')
    assert r.request_id is None and "200 chars" in r.detail


def test_detail_never_echoes_a_huge_value() -> None:
    huge = "z" * 3000
    r = decode_request(
        f'{{"id":"a","model":"{"q" * 120}","text":"{huge}","priority":"{huge}"}}'.encode(),
        model=MODEL,
        max_bytes=1 << 20,
    )
    assert isinstance(r, Rejection) and len(r.detail) <= 200
    r = decode_request(f'{{"id":"a","model":"m1","text":"{huge}"}} {huge}'.encode(), model=MODEL, max_bytes=1 << 20)
    assert isinstance(r, Rejection) and r.reason == "invalid_json" and len(r.detail) <= MAX_DETAIL_CHARS


def test_deep_nesting_does_not_recurse_out() -> None:
    assert decode_request(b"[" * 50_000, model=MODEL, max_bytes=1 << 20).reason == "schema"  # type: ignore[union-attr]
    deep = b'{"id":"a","model":"m1","text":"x","params":' + b'{"a":' * 3000 + b"1" + b"}" * 3001
    assert decode_request(deep, model=MODEL, max_bytes=1 << 20).reason == "schema"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        (None, None),
        ([], None),
        ([("batchtide-orig-ts", b"1764672000000")], 1764672000000),
        ([("content-type", b"garbage"), ("batchtide-orig-ts", b"1764672000000")], 1764672000000),
        ([("batchtide-orig-ts", b"not-a-number")], None),
        ([("batchtide-orig-ts", b"-1764672000000")], None),
        ([("batchtide-orig-ts", b"1764672000000.5")], None),
        ([("batchtide-orig-ts", b"99999999999999999999999")], None),
        ([("batchtide-orig-ts", b"12")], None),
        ([("batchtide-orig-ts", b"1764672000000\n")], None),
        ([("batchtide-orig-ts", b"\xff\xfe")], None),
        ([("batchtide-orig-ts", None)], None),
        ([("batchtide-enqueue-ms", b"1764672000000")], None),
    ],
)
def test_forward_headers_that_lie_are_ignored(
    headers: list[tuple[str, bytes | None]] | None, expected: int | None
) -> None:
    assert parse_forward_headers(headers) == expected


def test_recent_ids_flags_duplicates_and_forgets_old_ones() -> None:
    seen = RecentIds(capacity=2)
    a, _, c = (Request(id=x, model=MODEL, text="t", reply_topic="r") for x in "abc")
    assert seen.check(a) is None
    seen.add("a")
    dup = seen.check(a)
    assert dup is not None and dup.reason == "duplicate" and dup.request_id == "a" and dup.reply_topic == "r"
    seen.add("b")
    seen.add("c")
    assert seen.check(a) is None and seen.check(c) is not None and len(seen) == 2


def test_corpus_replayed_through_intake_and_a_simulated_runner() -> None:
    """Every corpus case gets exactly the reason its index promises (or is served)."""
    corpus = load_corpus()
    runner = make_runner(
        ModelConfig(
            name=corpus.model,
            runner="zero-cost",
            max_input_tokens=corpus.max_input_tokens,
            poison_marker=corpus.poison_marker,
        )
    )
    seen = RecentIds()
    outcomes: dict[str, str] = {}
    admitted: list[tuple[str, Request]] = []
    for case in corpus.cases:
        parse_forward_headers(case.headers)
        result = decode_request(case.value, model=corpus.model, max_bytes=corpus.max_message_bytes)
        if isinstance(result, Rejection):
            assert 0 < len(result.detail) <= MAX_DETAIL_CHARS
            outcomes[case.name] = result.reason
            continue
        verdict = check_reply_topic(result, "pipeline", f"pipeline.results.{corpus.model}") or seen.check(result)
        reason = runner.check(result)
        if verdict is not None:
            outcomes[case.name] = verdict.reason
        elif reason is not None:
            outcomes[case.name] = "input_too_long"
        else:
            seen.add(result.id)
            admitted.append((case.name, result))
    outputs, errors = run_isolating(runner, [r for _, r in admitted])
    for i, (name, _) in enumerate(admitted):
        outcomes[name] = "runner_error" if i in errors else "ok"
        assert (i in errors) != (i in outputs)
    expected = {c.name: c.expect for c in corpus.cases}
    assert outcomes == expected
    assert {c.expect for c in corpus.cases} == set(REASONS) | {"ok"}


def test_refused_builds_an_addressed_bounded_rejection() -> None:
    req = Request(id="q1", model=MODEL, text="x", reply_topic="replies")
    r = refused(req, "runner_error", "IndexError: " + "y" * 2000)
    assert (r.reason, r.request_id, r.reply_topic) == ("runner_error", "q1", "replies")
    assert r.detail.startswith("IndexError") and len(r.detail) <= MAX_DETAIL_CHARS
    assert refused(req, "input_too_long", "").detail == "input_too_long"
