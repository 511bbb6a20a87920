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
- ``reply_topic``    reply_topic names one of the pipeline's own topics (inside
                     its prefix) other than the model's results topic, or a
                     Kafka internal topic (``__...``); set by the loop
- ``input_too_long`` the runner's `check()` refused it (set by the loop): over
                     the token limit (the usual case), empty after
                     tokenization, or token ids outside the vocabulary;
                     the detail says which
- ``runner_error``   the runner raised on it alone (set by the loop after
                     bisection, see `consumers.runners.base.run_isolating`)
- ``duplicate``      request id already answered by this consumer recently
                     (see `RecentIds`; set by the loop)
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

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
    "reply_topic",
    "input_too_long",
    "runner_error",
    "duplicate",
)

ORIG_TS_HEADER: Final = "batchtide-orig-ts"
"""Header a tail-forwarded request carries: its original record timestamp (epoch ms)."""

_TOPIC_RE: Final = re.compile(r"[A-Za-z0-9._-]+")
_DIGITS_RE: Final = re.compile(rb"[0-9]{1,16}")
_SANE_EPOCH_MS: Final = (946_684_800_000, 4_102_444_800_000)  # 2000-01-01 .. 2100-01-01
_FIELD_PREVIEW: Final = 40


@dataclass(frozen=True)
class Rejection:
    """Why a record was not served; the loop turns it into a DeadLetter, a `rejected` Result (when it
    has an id) and a `rejected` latency event with this reason."""

    reason: str
    detail: str
    request_id: str | None = None
    reply_topic: str | None = None
    warmup: bool = False
    """The request said it is warm-up traffic: its refusal is stored but counted apart, like its answer would be."""
    trace_index: int | None = None
    """The decoded request's Request.trace_index (its refusal's event records it)."""


_decoder: Final = msgspec.json.Decoder(Request)
_ERROR_PATH_RE: Final = re.compile(r"^(?P<message>.*) - at `\$(?P<path>[^`]*)`$", re.DOTALL)
_PATH_STEP_RE: Final = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")


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


def _parsed(value: bytes) -> Any:
    """The payload as plain JSON values (error path only), or None if that fails too."""
    try:
        return msgspec.json.decode(value)
    except Exception:
        return None


def _address(doc: Any) -> tuple[str | None, str | None]:
    """Id and reply topic of a payload that failed validation, when they look valid."""
    if not isinstance(doc, dict):
        return None, None
    rid, topic = doc.get("id"), doc.get("reply_topic")
    request_id = rid if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_LEN else None
    reply = topic if isinstance(topic, str) and len(topic) <= MAX_TOPIC_LEN and _TOPIC_RE.fullmatch(topic) else None
    return request_id, reply


def _schema_detail(error: msgspec.ValidationError, doc: Any) -> str:
    """msgspec's message rewritten as `field: problem, got <value>` when the value is at hand."""
    try:
        return _located(str(error), doc)
    except Exception:
        return bounded(str(error))


def _located(text: str, doc: Any) -> str:
    match = _ERROR_PATH_RE.match(text)
    if match is None:
        return bounded(text)
    path, message = match["path"], match["message"]
    node: Any = doc
    for name, index in _PATH_STEP_RE.findall(path):
        if name and isinstance(node, dict) and name in node:
            node = node[name]
        elif index and isinstance(node, list) and int(index) < len(node):
            node = node[int(index)]
        else:
            return bounded(f"{path.lstrip('.')}: {message}")
    if isinstance(node, str):
        got = _preview(node)
    elif isinstance(node, (dict, list)):
        got = f"{type(node).__name__} of {len(node)} items"
    else:
        got = repr(node)
    if ", got `" in message:
        return bounded(f"{path.lstrip('.')}: {message} ({got})")
    return bounded(f"{path.lstrip('.')}: {message}, got {got}")


def decode_request(value: bytes | None, *, model: str, max_bytes: int) -> Request | Rejection:
    """Decode and validate one record value for the model served on this topic."""
    if not value:
        return Rejection("empty", "record value is empty" if value is not None else "record value is null")
    if len(value) > max_bytes:
        return Rejection("oversize", f"record value is {len(value)} bytes; the limit is {max_bytes}")
    try:
        req = _decoder.decode(value)
    except msgspec.ValidationError as e:
        doc = _parsed(value)
        request_id, reply = _address(doc)
        warmup = isinstance(doc, dict) and doc.get("warmup") is True
        return Rejection("schema", _schema_detail(e, doc), request_id, reply, warmup)
    except msgspec.DecodeError as e:
        return _undecodable(value, e)
    except UnicodeDecodeError as e:
        return Rejection("not_utf8", bounded(f"invalid UTF-8 at byte {e.start}: {e.reason}"))
    except RecursionError:
        return Rejection("invalid_json", "JSON nesting is too deep")
    except Exception as e:
        return Rejection("invalid_json", bounded(f"undecodable ({type(e).__name__}): {e}"))
    if req.reply_topic is not None and not _TOPIC_RE.fullmatch(req.reply_topic):
        # msgspec's `$` also matches before a trailing newline; Kafka would refuse the topic
        return Rejection(
            "schema",
            f"reply_topic: must be letters, digits, '.', '_' or '-' only, got {_preview(req.reply_topic)}",
            req.id,
            warmup=req.warmup,
        )
    if req.model != model:
        return Rejection(
            "model_mismatch",
            f"request is for model {_preview(req.model)} but this topic serves {model!r}",
            req.id,
            req.reply_topic,
            req.warmup,
        )
    return req


def _undecodable(value: bytes, error: msgspec.DecodeError) -> Rejection:
    """Tell broken UTF-8 apart from broken JSON (msgspec reports both as malformed)."""
    try:
        value.decode("utf-8")
    except UnicodeDecodeError as e:
        return Rejection("not_utf8", f"invalid UTF-8 at byte {e.start}: {e.reason}")
    return Rejection("invalid_json", bounded(str(error)))


def refused(req: Request, reason: str, detail: str) -> Rejection:
    """A Rejection for a request that decoded fine but cannot be served (loop-side reasons)."""
    return Rejection(reason, bounded(detail) or reason, req.id, req.reply_topic)


def check_reply_topic(req: Request, prefix: str, results_topic: str) -> Rejection | None:
    """Refuse a reply topic that would write an answer into the pipeline's own plumbing.

    Answers on another model's results topic, a request topic or an events
    topic would be read by the wrong consumers; the model's own results topic
    is allowed (it is the default anyway). The rejection has no reply topic,
    so its answer goes to the model's results topic.
    """
    why = reply_topic_problem(req.reply_topic, prefix, results_topic)
    return None if why is None else Rejection("reply_topic", bounded(why), req.id)


def reply_topic_problem(topic: str | None, prefix: str, results_topic: str) -> str | None:
    """Why answers may not go to `topic` (None: they may)."""
    if topic is None or topic == results_topic:
        return None
    if topic.startswith("__"):
        return f"reply_topic {_preview(topic)} is a Kafka internal topic"
    if topic.startswith(f"{prefix}."):
        return (
            f"reply_topic {_preview(topic)} is one of the pipeline's own topics ({prefix}.*); "
            f"leave it out or use {results_topic!r} for this model's results topic"
        )
    return None


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
            if not _DIGITS_RE.fullmatch(raw):
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
