"""What goes into the batching engine and what comes out of it.

These types are the whole contract between the pure policy and its drivers
(the live Kafka consumer, the simulator, the peer policies of the benchmark).
Times are milliseconds on the driver's clock: the live consumer passes wall
clock epoch ms (so Kafka CreateTime compares directly), the simulator passes
virtual ms. The engine never reads a clock itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

DispatchReason = Literal["hard_cap", "target", "idle", "max_wait"]


@dataclass(slots=True, eq=False)
class PendingRequest:
    """One request as the engine sees it; `payload` is the driver's, opaque here."""

    request_id: str
    enqueue_ms: float
    """Record timestamp (Kafka CreateTime): waiting is measured from here."""
    cost: int = 1
    """Size in the profile's cost unit: 1 for `requests`, prompt+output tokens for `tokens`."""
    priority: int = 0
    """Client priority level, 0 = most urgent."""
    deadline_ms: float | None = None
    """Absolute time after which the request is answered `expired` instead of run."""
    payload: Any = None
    marked: bool = False
    """Set by the engine when the request became a tail (sticky)."""
    marked_at_ms: float | None = None
    seq: int = 0
    """The engine's handle for this request while it is pending (see `withdraw`)."""
    finish_by_ms: float | None = None
    """Set by the engine: the latest useful finish (deadline, or record time + SLO; see
    engine/shedding.py); None when the request may wait as long as it takes."""
    finish_by_reason: str = ""
    """What missing `finish_by_ms` means: `cannot_meet_deadline` or `cannot_meet_slo`."""
    expiry: str | None = None
    """Why it was answered `expired` (set when it was): `deadline` (passed while it waited),
    `cannot_meet_deadline` or `cannot_meet_slo` (shed: its expected finish was too late)."""
    predicted_done_ms: float | None = None
    """A shed request's expected finish when it was shed (after `finish_by_ms`)."""


@dataclass(slots=True)
class DispatchRecord:
    """Why a batch left the queue when it did; one per batch (a BatchEvent on the wire)."""

    batch_id: int
    size: int
    cost: int
    reason: DispatchReason
    window_ms: float
    """The wait the policy had decided on for this batch (0 when it did not wait)."""
    hit_target: bool
    marked_count: int
    oldest_wait_ms: float
    queue_depth: int
    """Requests still pending after this dispatch, plus the caller's known backlog."""
    effective_cap: int
    arrival_rate_per_s: float
    dispatch_ms: float
    cap_reason: str = "configured"
    """Where effective_cap came from: configured, knee, budget (a short queue, shaped to
    the compute budget), shift (t(b) moved), probe (a deliberate off-cap size that
    measures the curve) or ramp (climbing from the target while bigger batches pay)."""
    target_size: int = 0
    """The target in force for this batch (`auto`: two thirds of its cap)."""


@dataclass(slots=True)
class Batch:
    batch_id: int
    requests: list[PendingRequest]
    record: DispatchRecord

    @property
    def size(self) -> int:
        return len(self.requests)


@dataclass(slots=True)
class Decision:
    """The engine's answer to one poll.

    `batch`: run this now (None: nothing to run). `expired`: answer these with an
    `expired` result, do not run them (each request's `expiry` says why). `wake_at_ms`: poll again no later than
    this even if nothing arrives (None: only an arrival or a completion can
    change the decision).
    """

    batch: Batch | None = None
    expired: list[PendingRequest] = field(default_factory=list)
    wake_at_ms: float | None = None


class BatchPolicy(Protocol):
    """The interface every policy implements, batchtide's engine and the peers alike."""

    def offer(self, request: PendingRequest, now_ms: float) -> None: ...

    def poll(self, now_ms: float, device_free: bool = True, backlog: int = 0) -> Decision:
        """Decide at `now_ms`. `device_free`: the driver's device can take a batch
        (the engine also enforces max_inflight_batches itself). `backlog`: requests
        known to be waiting outside the engine (Kafka lag of assigned partitions)."""
        ...

    def completed(self, batch: Batch, now_ms: float, compute_ms: float) -> None: ...

    @property
    def pending(self) -> int: ...


class LearnedCost(Protocol):
    """What a driver reads of a policy's learned batch time t(b)."""

    @property
    def cap(self) -> int:
        """The batch size a backlog is served at."""
        ...

    def estimate_ms(self, size: float) -> float | None:
        """t(size) in ms; None before anything was measured."""
        ...


class ServingPolicy(BatchPolicy, Protocol):
    """What the live consumer needs of its policy beyond the simulator's loop: the resolved
    ceiling (the runner refuses what could never fit), taking a request back (forwarded to a
    peer, or its partition revoked), the learned t(b) (the consumer's beacon and its forwards
    are predicted from it) and a snapshot for its lag events."""

    @property
    def ceiling(self) -> int: ...

    @property
    def curve(self) -> LearnedCost: ...

    def withdraw(self, request: PendingRequest) -> bool: ...

    def stats(self) -> dict[str, Any]: ...
