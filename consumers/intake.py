"""Request intake: turn one Kafka record value into a `Request` or a `Rejection`.

This is the consumer's hot path and its first line of defence. Nothing a
producer sends may raise out of here: every failure becomes a `Rejection`
with a stable `reason` code (what the dead-letter topic and dashboards group
by) and a bounded, human-readable `detail` (what a person reads to fix the
producer). The decoder is msgspec's strict JSON decoder for the wire
`Request`, so type, range, unknown-field and size checks cost one pass.

Reason codes:

- ``empty``          record value is null or zero bytes
- ``oversize``       value longer than the consumer's `max_message_bytes`
- ``not_utf8``       value is not valid UTF-8
- ``invalid_json``   not JSON, truncated JSON, trailing garbage
- ``schema``         JSON, but not a valid Request (wrong types, missing
                     fields, out-of-range priority/deadline, both or neither
                     of text/token_ids, unknown fields, unknown version)
- ``model_mismatch`` request.model is not the model this topic serves
- ``input_too_long`` the runner's `check()` refused it (set by the loop)
- ``runner_error``   the runner raised on it alone (set by the loop after
                     bisection, see `consumers.runners.base.run_isolating`)
- ``duplicate``      request id already answered by this consumer recently
                     (see `RecentIds`; set by the loop)
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final, Iterable

import msgspec

from schemas.messages import MAX_ID_LEN, MAX_TOPIC_LEN, Request

MAX_DETAIL_CHARS: Final = 500
"""Upper bound on `Rejection.detail`: a hostile 100 KB field is never echoed."""

REASONS: Final = (
    "empty",
    "oversize",
    "not_utf8",
    "invalid_json",
    "schema",
    "model_mismatch",
    "input_too_long",
    "runner_error",
    "duplicate",
)

ORIG_TS_HEADER: Final = "batchtide-orig-ts"
"""Header a tail-forwarded request carries: its original record timestamp (epoch ms)."""

_TOPIC_RE: Final = re.compile(r"^[A-Za-z0-9._-]+$")
_DIGITS_RE: Final = re.compile(rb"^[0-9]{1,16}$")
_SANE_EPOCH_MS: Final = (946_684_800_000, 4_102_444_800_000)  # 2000-01-01 .. 2100-01-01
_FIELD_PREVIEW: Final = 40


@dataclass(frozen=True)
class Rejection:
    """Why a record was not served; the loop turns it into a DeadLetter (+ error Result)."""

    reason: str
    detail: str
    request_id: str | None = None
    reply_topic: str | None = None


class _Envelope(msgspec.Struct):
    """Lenient view of a rejected payload: just enough to address an error Result."""

    id: Any = None
    reply_topic: Any = None


_decoder: Final = msgspec.json.Decoder(Request)
_envelope_decoder: Final = msgspec.json.Decoder(_Envelope)


def bounded(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """Cut `text` to `limit` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    keep = limit - 32
    return f"{text[:keep]}... [{len(text) - keep} more chars]"


def _preview(value: str) -> str:
    if len(value) <= _FIELD_PREVIEW:
        return repr(value)
    return repr(value[:_FIELD_PREVIEW]) + f"... ({len(value)} chars)"


def _address(value: bytes) -> tuple[str | None, str | None]:
    """Best-effort id and reply topic of a payload that failed validation."""
    try:
        env = _envelope_decoder.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, ValueError):
        return None, None
    request_id = env.id if isinstance(env.id, str) and 0 < len(env.id) <= MAX_ID_LEN else None
    topic = env.reply_topic
    reply = topic if isinstance(topic, str) and len(topic) <= MAX_TOPIC_LEN and _TOPIC_RE.match(topic) else None
    return request_id, reply


def decode_request(value: bytes | None, *, model: str, max_bytes: int) -> Request | Rejection:
    """Decode and validate one record value for the model served on this topic."""
    if not value:
        return Rejection("empty", "record value is empty" if value is not None else "record value is null")
    if len(value) > max_bytes:
        return Rejection("oversize", f"record value is {len(value)} bytes; the limit is {max_bytes}")
    try:
        req = _decoder.decode(value)
    except msgspec.ValidationError as e:
        request_id, reply = _address(value)
        return Rejection("schema", bounded(str(e)), request_id, reply)
    except msgspec.DecodeError as e:
        return _undecodable(value, e)
    except UnicodeDecodeError as e:
        return Rejection("not_utf8", bounded(f"invalid UTF-8 at byte {e.start}: {e.reason}"))
    if req.model != model:
        return Rejection(
            "model_mismatch",
            f"request is for model {_preview(req.model)} but this topic serves {model!r}",
            req.id,
            req.reply_topic,
        )
    return req


def _undecodable(value: bytes, error: msgspec.DecodeError) -> Rejection:
    """Tell broken UTF-8 apart from broken JSON (msgspec reports both as malformed)."""
    try:
        value.decode("utf-8")
    except UnicodeDecodeError as e:
        return Rejection("not_utf8", f"invalid UTF-8 at byte {e.start}: {e.reason}")
    return Rejection("invalid_json", bounded(str(error)))


def parse_forward_headers(headers: Iterable[tuple[str, bytes | None]] | None) -> int | None:
    """Original enqueue time (epoch ms) of a tail-forwarded request, or None.

    Headers come from any producer and may lie: a value that is missing, not
    ASCII digits, or outside 2000..2100 is ignored rather than trusted.
    """
    if not headers:
        return None
    try:
        for key, raw in headers:
            if key != ORIG_TS_HEADER or not isinstance(raw, (bytes, bytearray)):
                continue
            if not _DIGITS_RE.match(raw):
                return None
            ms = int(raw)
            return ms if _SANE_EPOCH_MS[0] <= ms < _SANE_EPOCH_MS[1] else None
    except (TypeError, ValueError):
        return None
    return None


class RecentIds:
    """Bounded memory of request ids this consumer has answered, for the `duplicate` reason.

    Kafka delivery is at-least-once, and producers retry; a request id seen
    again within the last `capacity` answers is rejected as `duplicate`
    instead of being computed twice. Older ids are forgotten (a redelivery
    after a crash lands on a consumer with no memory and is simply served
    again; its Result carries the same id so clients can dedupe).
    """

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (got {capacity})")
        self._capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        if len(self._ids) > self._capacity:
            self._ids.popitem(last=False)

    def check(self, req: Request) -> Rejection | None:
        """A `duplicate` rejection if `req.id` was answered recently, else None."""
        if req.id in self._ids:
            return Rejection(
                "duplicate",
                f"request id {_preview(req.id)} was already answered by this consumer",
                req.id,
                req.reply_topic,
            )
        return None
