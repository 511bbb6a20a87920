"""Wire messages: JSON on Kafka, versioned, with JSON Schema exported beside this file.

Producers in any language write `Request` JSON to `<prefix>.requests.<model>`;
the record's CreateTime is the enqueue time. Consumers answer with `Result` on
`<prefix>.results.<model>` (or the request's `reply_topic`) keyed by request
id, and emit one `LatencyEvent` per request and one `BatchEvent` per batch.

Limits on every field are part of the contract, so hostile input is rejected
with a precise reason before it can cost memory or compute.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

SCHEMA_VERSION = 1

MAX_ID_LEN = 128
MAX_TEXT_CHARS = 100_000
MAX_TOKEN_IDS = 32_768
MAX_TOPIC_LEN = 249  # Kafka's own limit on topic names
MAX_NEW_TOKENS = 4096

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]
Priority = Annotated[int, msgspec.Meta(ge=0, le=9)]
Outcome = Literal["ok", "expired", "error", "rejected"]


class GenerationParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_NEW_TOKENS)] = 32
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=10.0)] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    ignore_eos: bool = False
    """Generate exactly `max_new_tokens`: an end-of-sequence token does not end the answer (it is
    kept as a token; vLLM's parameter of that name). A replayed trace forces its answer lengths so."""


class Request(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """An inference request. Exactly one of `text` and `token_ids` is set."""

    id: RequestId
    model: ModelName
    text: Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)] | None = None
    token_ids: (
        Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]], msgspec.Meta(max_length=MAX_TOKEN_IDS)] | None
    ) = None
    params: GenerationParams | None = None
    priority: Priority = 1
    """0 = most urgent; the default 1 leaves room for a client to jump the queue."""
    deadline_ms: Annotated[int, msgspec.Meta(gt=0, lt=2**53)] | None = None
    """Absolute epoch ms after which the answer is `expired` instead of a late result."""
    timeout_ms: Annotated[int, msgspec.Meta(gt=0, le=86_400_000)] | None = None
    """Relative deadline from the record timestamp (used when deadline_ms is unset)."""
    reply_topic: (
        Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TOPIC_LEN, pattern=r"^[A-Za-z0-9._-]+$")] | None
    ) = None
    first_token_deadline_ms: Annotated[int, msgspec.Meta(gt=0, lt=2**53)] | None = None
    """Generation: absolute epoch ms past which a first token is of no use. A request whose prompt, and
    those served before it, cannot be prefilled by then at the device's measured pace is answered
    `expired` (`cannot_meet_slo`) without running. An iteration-level consumer with a time-to-first-token
    objective (slo_p99_ms beside slo_ms_per_new_token, `shed_when = "slo"`) sets it to the record time
    plus that objective when the request has none."""
    warmup: bool = False
    """Warm-up traffic, set by whoever sends it: answered as usual, left out of the latency figures."""
    trace_index: Annotated[int, msgspec.Meta(ge=0, lt=2**31)] | None = None
    """A request replayed from a trace file: its index there (0-based data row), copied to its latency event."""
    v: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if (self.text is None) == (self.token_ids is None):
            raise msgspec.ValidationError("exactly one of `text` and `token_ids` must be set")
        if self.v != SCHEMA_VERSION:
            raise msgspec.ValidationError(
                f"unsupported schema version v={self.v} (this consumer speaks v={SCHEMA_VERSION})"
            )


class Result(msgspec.Struct, omit_defaults=True):
    id: str
    model: str
    outcome: Outcome
    embedding: list[float] | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    error: str | None = None
    batch_id: int | None = None
    consumer_id: str | None = None
    enqueue_ms: int = 0
    done_ms: int = 0
    reply_error: str | None = None
    """Set when the request named a `reply_topic` that could not take the answer (missing, not
    allowed, refusing writes): why this answer is on the model's results topic instead."""
    v: int = SCHEMA_VERSION


class LatencyEvent(msgspec.Struct, omit_defaults=False):
    """One per answered request: the row of ClickHouse `request_latency`."""

    request_id: str
    model: str
    consumer_id: str
    outcome: Outcome
    enqueue_ms: int
    fetch_ms: int
    dispatch_ms: int
    compute_start_ms: int
    compute_end_ms: int
    produce_ms: int
    wait_ms: float
    compute_ms: float
    e2e_ms: float
    batch_id: int
    batch_size: int
    tail_marked: bool
    priority: int
    tokens_in: int
    tokens_out: int
    device_mem_bytes: int
    device_mem_kind: Literal["cuda_max_allocated", "process_rss", "none"]
    partition: int
    offset: int
    forwarded: bool = False
    warmup: bool = False
    """The request was warm-up traffic (Request.warmup): stored, but not counted in latency figures."""
    first_token_ms: int = 0
    """Generation: epoch ms its first token was decoded (time to first token = this - enqueue_ms);
    0 for models that do not generate and for requests that did not run."""
    last_token_ms: int = 0
    """Generation: epoch ms its last token was decoded (time per output token =
    (last_token_ms - first_token_ms) / (tokens_out - 1)); 0 when first_token_ms is."""
    reason: str = ""
    """Why a request was not answered `ok` (a rejection's reason such as `schema` or `too_long`,
    `runner_error`, `deadline`, `cannot_meet_slo` or `cannot_meet_deadline` (shed before it ran),
    `oversize`); empty for `ok`."""
    trace_index: int = -1
    """The request's index in the trace it was replayed from (Request.trace_index); -1 for none."""
    v: int = SCHEMA_VERSION


class BatchEvent(msgspec.Struct, omit_defaults=False):
    """One per dispatched batch: the row of ClickHouse `batches` (the dispatch record of docs/engine.md)."""

    batch_id: int
    model: str
    consumer_id: str
    dispatch_ms: int
    size: int
    cost: int
    reason: str
    window_ms: float
    hit_target: bool
    target_size: int
    marked_count: int
    oldest_wait_ms: float
    queue_depth: int
    effective_cap: int
    cap_reason: str
    arrival_rate_per_s: float
    compute_ms: float
    tokens_in: int
    tokens_out: int
    device_mem_bytes: int
    device_mem_kind: str
    v: int = SCHEMA_VERSION


class DeadLetter(msgspec.Struct):
    """A record the consumer could not serve: why, where it came from, and the original bytes.

    `topic`, `partition` and `offset` locate the source record. The original
    is kept whole when the dead-letter topic's `max.message.bytes` allows,
    else its first bytes with `truncated` set; `original_size` and
    `original_sha256` always describe the whole record value.
    """

    reason: str
    detail: str
    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    consumer_id: str
    original_b64: str
    original_size: int
    original_sha256: str
    truncated: bool = False
    request_id: str | None = None
    v: int = SCHEMA_VERSION


def batch_event_id(consumer_id: str, batch_id: int) -> str:
    """Batch ids are per consumer; this pair is globally unique (ClickHouse dedupe key)."""
    return f"{consumer_id}:{batch_id}"


class PartitionLag(msgspec.Struct, omit_defaults=False):
    """One partition of a consumer's assignment, as Kafka sees it when the sample is taken."""

    topic: str
    partition: int
    end_offset: int
    committed_offset: int
    """-1 when the group has committed nothing on this partition yet (lag counts from its first record)."""
    lag: int
    """end_offset - committed_offset: records not yet answered and committed."""
    oldest_ms: int
    """CreateTime of the oldest record not yet answered (the one at the committed offset); 0 with no lag."""
    lag_age_ms: float
    """How long that record has waited when the sample is taken (kafka-lag-exporter's lag in time); 0 with no lag."""


class LagEvent(msgspec.Struct, omit_defaults=False):
    """One per consumer every `lag_interval_ms`: its partitions' lag and the engine's state.

    ClickHouse `consumer_lag` holds one row per partition; `batchtide status`
    reads the latest event of each consumer straight from the topic."""

    ts_ms: int
    model: str
    consumer_id: str
    group: str
    partitions: list[PartitionLag]
    queue: int
    """Requests held in the engine (fetched, not yet dispatched)."""
    inflight: int
    window_ms: float
    effective_cap: int
    cap_reason: str
    marked_share: float
    arrival_rate_per_s: float
    batches: int
    """Batches dispatched since the consumer started (a counter; rates come from differences)."""
    last_batch_ms: int
    """Wall-clock ms of the last dispatched batch, seen to within a second; 0 before the first."""
    dead_letters: int
    """Records sent to the DLQ since the consumer started (a counter)."""
    capacity_per_s: float = 0.0
    """Requests per second this consumer's device sustains at its learned knee (cap / t(cap));
    0 before it has measured a batch. The group's balance compares members by it."""
    v: int = SCHEMA_VERSION


class FleetBeacon(msgspec.Struct, omit_defaults=False):
    """One per consumer every `fleet_beacon_ms` on `<prefix>.fleet`: how soon it could serve one more
    request. Its peers forward waiting requests to it when it would finish them clearly sooner."""

    member_id: str
    model: str
    group: str
    at_ms: int
    """Wall-clock ms when the beacon was made (peers age `start_in_ms` by it)."""
    start_in_ms: float
    """How long a request handed to it at `at_ms` would wait for the device."""
    batch_ms: float
    """Its recent batch compute time (a moving average; t(1) from its learned curve before any batch)."""
    capacity_per_s: float
    """Cost units per second at its knee; 0 before it measured a batch."""
    partitions: list[int]
    """Partitions of the model's priority topic it owns."""
    load: float | None = None
    """Cost units of its own traffic (forwards in left out) offered to it per second over its capacity
    (null from consumers before it)."""
    first_token_ms: float | None = None
    """Generation, iteration-level: dispatch to first token once it has room (the join and the prefill),
    median of its recent answers; with it, `start_in_ms` is how long one more request would wait for room.
    Null from a consumer that runs batches (and from consumers before it)."""
    decode_steps: list[tuple[int, float]] | None = None
    """Generation: its decode step by requests on its device, [[rows, ms], ...], non-decreasing (learned
    from its answers' time per output token); empty before any answer."""
    running: int | None = None
    """Generation: requests on its device now (running or joining)."""
    room: int | None = None
    """Generation: requests it could start now beyond its waiting queue (free device slots)."""
    slot_every_ms: float | None = None
    """Generation: once it is full, how often one of its running requests ends."""
    batches: int | None = None
    """Batches it has measured since it started (null from consumers before it): a share-mode peer
    restrains a slower member only on enough of them."""
    unit_ms: float | None = None
    """Its learned t(1), ms (null before it measured a batch, and from consumers before it): a share-mode peer
    restrains a slower member only when this and the capacity both say so."""
    drained_at_ms: float | None = None
    """Share mode: wall-clock ms when its newest request poll that left the broker empty (fewer records
    than it asked for) returned; null outside share mode, before one, and from consumers before it. A
    slower member judges the age of what it would pull by it."""
    v: int = SCHEMA_VERSION
