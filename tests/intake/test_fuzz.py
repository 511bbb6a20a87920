"""Hypothesis-generated hostile messages: intake never raises, and always answers
with a Request for this topic's model or a Rejection with a bounded, non-empty detail."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers.intake import MAX_DETAIL_CHARS, REASONS, Rejection, decode_request, parse_forward_headers
from schemas.messages import MAX_ID_LEN, Request, Result

MODEL = "fuzz-model"
MAX_BYTES = 64 * 1024
FIELDS = ["id", "model", "text", "token_ids", "params", "priority", "deadline_ms", "timeout_ms", "reply_topic", "v"]
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

absurd_numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 9, 10, 2**31, 2**53, 2**53 + 1, 2**63, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
)
huge_strings = st.builds(
    lambda ch, n: ch * n, st.sampled_from(["x", "é", "東", "🚀", "\\", '"']), st.integers(0, 40_000)
)
json_leaf = st.one_of(st.none(), st.booleans(), absurd_numbers, st.text(max_size=50), huge_strings)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)),
    max_leaves=20,
)
field_value = st.one_of(
    json_value,
    st.just(MODEL),
    st.lists(absurd_numbers, max_size=50),
    st.builds(lambda n: [1] * n, st.integers(0, 40_000)),
    st.fixed_dictionaries(
        {}, optional={"max_new_tokens": absurd_numbers, "temperature": absurd_numbers, "top_p": absurd_numbers}
    ),
)
request_like = st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=10)), field_value, max_size=8)
valid_input = st.one_of(
    st.fixed_dictionaries({"text": st.text(max_size=200)}),
    st.fixed_dictionaries({"token_ids": st.lists(st.integers(0, 2**31 - 1), max_size=50)}),
)
valid_extras = st.fixed_dictionaries(
    {},
    optional={
        "priority": st.integers(0, 9),
        "deadline_ms": st.integers(1, 2**53 - 1),
        "timeout_ms": st.integers(1, 86_400_000),
        "reply_topic": st.one_of(
            st.from_regex(r"[A-Za-z0-9._-]{1,40}", fullmatch=True),
            st.from_regex(r"[A-Za-z0-9._-]{1,40}\n?", fullmatch=False),
        ),
        "params": st.fixed_dictionaries({}, optional={"max_new_tokens": st.integers(1, 4096)}),
    },
)


@st.composite
def plausible(draw: st.DrawFn) -> dict[str, Any]:
    """A valid request for this model or another, with up to two fields made hostile."""
    doc: dict[str, Any] = {
        "id": draw(st.text(min_size=1, max_size=MAX_ID_LEN)),
        "model": draw(st.sampled_from([MODEL, MODEL, MODEL, "other-model"])),
        **draw(valid_input),
        **draw(valid_extras),
    }
    for name in draw(st.lists(st.sampled_from([*FIELDS, "extra"]), max_size=2)):
        doc[name] = draw(field_value)
    return doc


def _to_json(doc: Any) -> bytes:
    return json.dumps(doc, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")


@st.composite
def mangled(draw: st.DrawFn) -> bytes:
    """A JSON payload, then maybe truncated, spliced with random bytes or re-encoded."""
    raw = _to_json(draw(st.one_of(plausible(), request_like, json_value)))
    how = draw(st.sampled_from(["as_is", "truncate", "splice", "latin1", "utf16", "prefix"]))
    if how == "truncate" and raw:
        return raw[: draw(st.integers(0, len(raw) - 1))]
    if how == "splice" and raw:
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + draw(st.binary(min_size=1, max_size=16)) + raw[at:]
    if how == "latin1":
        return raw.decode("utf-8", "surrogatepass").encode("latin-1", "replace")
    if how == "utf16":
        return raw.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass")
    if how == "prefix":
        return b"\xef\xbb\xbf" + raw
    return raw


def _check(value: bytes | None) -> Request | Rejection:
    result = decode_request(value, model=MODEL, max_bytes=MAX_BYTES)
    if isinstance(result, Rejection):
        assert result.reason in REASONS
        assert 0 < len(result.detail) <= MAX_DETAIL_CHARS
        assert result.request_id is None or 0 < len(result.request_id) <= MAX_ID_LEN
        assert result.reply_topic is None or re.fullmatch(r"[A-Za-z0-9._-]{1,249}", result.reply_topic)
        return result
    assert isinstance(result, Request)
    assert value is not None and len(value) <= MAX_BYTES
    assert result.model == MODEL
    assert (result.text is None) != (result.token_ids is None)
    assert 0 <= result.priority <= 9
    assert result.reply_topic is None or re.fullmatch(r"[A-Za-z0-9._-]{1,249}", result.reply_topic)
    # whatever was accepted can be answered: a Result carrying it encodes as JSON
    answer = Result(id=result.id, model=result.model, outcome="ok", text=result.text, token_ids=result.token_ids)
    assert msgspec.json.decode(msgspec.json.encode(answer), type=Result) == answer
    return result


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_never_raise(value: bytes) -> None:
    _check(value)


@FUZZ
@given(mangled())
def test_mangled_json_never_raises(value: bytes) -> None:
    _check(value)


@FUZZ
@given(plausible())
def test_plausible_requests_are_served_or_precisely_rejected(doc: dict[str, Any]) -> None:
    result = _check(_to_json(doc))
    if isinstance(result, Rejection) and result.reason == "schema":
        # a schema rejection names the field at fault or the rule broken
        assert any(name in result.detail for name in [*doc, *FIELDS, "object", "exactly one", "version"])


@FUZZ
@given(
    st.one_of(
        st.none(), st.lists(st.tuples(st.text(max_size=30), st.one_of(st.none(), st.binary(max_size=40))), max_size=6)
    )
)
def test_lying_headers_never_raise(headers: list[tuple[str, bytes | None]] | None) -> None:
    ts = parse_forward_headers(headers)
    assert ts is None or 946_684_800_000 <= ts < 4_102_444_800_000
