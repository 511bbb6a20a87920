"""Peer batching policies, re-implemented from their documented behaviour.

Each implements the BatchPolicy protocol of pipeline/core/engine/decisions.py so the
simulator drives them exactly like batchtide's engine. What each one does, and
the source of the behaviour, is in its docstring; docs/benchmarks.md has the
knobs and grids. Where a documented detail would only hurt the peer (BentoML
popping the newest request first), the peer gets the stronger choice.
"""

from __future__ import annotations

from collections import deque

from pipeline.core.engine.decisions import Batch, Decision, DispatchReason, DispatchRecord, PendingRequest


class QueuedPolicy:
    """Shared plumbing: per-priority FIFO deques, in-flight count, dispatch records."""

    def __init__(self, max_inflight: int = 1, priority_levels: int = 1) -> None:
        self.max_inflight = max_inflight
        self.levels: list[deque[PendingRequest]] = [deque() for _ in range(max(1, priority_levels))]
        self.count = 0
        self.inflight = 0
        self.next_batch_id = 0

    @property
    def pending(self) -> int:
        return self.count

    def offer(self, request: PendingRequest, now_ms: float) -> None:
        level = min(max(request.priority, 0), len(self.levels) - 1)
        self.levels[level].append(request)
        self.count += 1

    def oldest_ms(self) -> float:
        """Record time of the oldest pending request (the wait timer starts there)."""
        return min(q[0].enqueue_ms for q in self.levels if q)

    def take(self, n: int) -> list[PendingRequest]:
        out: list[PendingRequest] = []
        for q in self.levels:
            while q and len(out) < n:
                out.append(q.popleft())
            if len(out) >= n:
                break
        self.count -= len(out)
        return out

    def can_run(self, device_free: bool) -> bool:
        return device_free and self.inflight < self.max_inflight

    def dispatch(
        self,
        requests: list[PendingRequest],
        now_ms: float,
        reason: DispatchReason,
        window_ms: float,
        target: int,
        cap: int,
    ) -> Decision:
        self.inflight += 1
        self.next_batch_id += 1
        oldest = min(r.enqueue_ms for r in requests)
        record = DispatchRecord(
            batch_id=self.next_batch_id,
            size=len(requests),
            cost=sum(r.cost for r in requests),
            reason=reason,
            window_ms=window_ms,
            hit_target=len(requests) >= target,
            marked_count=0,
            oldest_wait_ms=now_ms - oldest,
            queue_depth=self.count,
            effective_cap=cap,
            arrival_rate_per_s=0.0,
            dispatch_ms=now_ms,
        )
        return Decision(batch=Batch(self.next_batch_id, requests, record))

    def completed(self, batch: Batch, now_ms: float, compute_ms: float) -> None:
        self.inflight -= 1


class FixedWindow(QueuedPolicy):
    """Wait `window_ms` from the oldest pending request, dispatch at once when `cap` are pending.

    The field report's static knob (their baseline: 20 ms, cap 48). window 0 is greedy dispatch.
    """

    def __init__(self, window_ms: float, cap: int, max_inflight: int = 1) -> None:
        super().__init__(max_inflight)
        self.window_ms = window_ms
        self.cap = cap

    def poll(self, now_ms: float, device_free: bool = True, backlog: int = 0) -> Decision:
        if not self.count or not self.can_run(device_free):
            return Decision()
        if self.count >= self.cap:
            return self.dispatch(self.take(self.cap), now_ms, "hard_cap", self.window_ms, self.cap, self.cap)
        due = self.oldest_ms() + self.window_ms
        if now_ms >= due:
            return self.dispatch(self.take(self.cap), now_ms, "max_wait", self.window_ms, self.cap, self.cap)
        return Decision(wake_at_ms=due)


class TritonDynamic(QueuedPolicy):
    """Triton's dynamic batcher (docs: user-guide/batcher.html, model_config.proto).

    When an instance is free: a batch of `max_batch_size` goes at once; else the
    largest `preferred_batch_size` that can be formed goes at once; else the
    scheduler delays up to `max_queue_delay` counted from the oldest request, then
    sends what it has. Requests are queued per priority level, highest first.
    """

    def __init__(
        self,
        max_batch_size: int,
        max_queue_delay_ms: float,
        preferred: tuple[int, ...] = (),
        priority_levels: int = 1,
        max_inflight: int = 1,
    ) -> None:
        super().__init__(max_inflight, priority_levels)
        self.max_batch = max_batch_size
        self.delay_ms = max_queue_delay_ms
        self.preferred = sorted(p for p in preferred if p <= max_batch_size)

    def poll(self, now_ms: float, device_free: bool = True, backlog: int = 0) -> Decision:
        if not self.count or not self.can_run(device_free):
            return Decision()
        target = self.preferred[-1] if self.preferred else self.max_batch
        if self.count >= self.max_batch:
            return self.dispatch(self.take(self.max_batch), now_ms, "hard_cap", self.delay_ms, target, self.max_batch)
        fits = [p for p in self.preferred if p <= self.count]
        if fits:
            return self.dispatch(self.take(fits[-1]), now_ms, "target", self.delay_ms, target, self.max_batch)
        due = self.oldest_ms() + self.delay_ms
        if now_ms >= due:
            return self.dispatch(self.take(self.max_batch), now_ms, "max_wait", self.delay_ms, target, self.max_batch)
        return Decision(wake_at_ms=due)


class TFServingBasic(QueuedPolicy):
    """TF Serving's basic batch scheduler (batching_util/basic_batch_scheduler.h).

    Tasks join the open batch; a batch is closed when it is full
    (`max_batch_size`) and queued for the batch threads. A free thread takes the
    oldest closed batch, or the open batch once `batch_timeout_micros` passed since
    its first task was enqueued. A closed batch is never topped up later.
    `num_batch_threads` = the devices behind the queue.
    """

    def __init__(self, max_batch_size: int, batch_timeout_ms: float, max_inflight: int = 1) -> None:
        super().__init__(max_inflight)
        self.max_batch = max_batch_size
        self.timeout_ms = batch_timeout_ms
        self.closed: deque[list[PendingRequest]] = deque()
        self.open: list[PendingRequest] = []
        self.open_since = 0.0

    def offer(self, request: PendingRequest, now_ms: float) -> None:
        if not self.open:
            self.open_since = now_ms
        self.open.append(request)
        self.count += 1
        if len(self.open) >= self.max_batch:
            self.closed.append(self.open)
            self.open = []

    def poll(self, now_ms: float, device_free: bool = True, backlog: int = 0) -> Decision:
        if not self.count or not self.can_run(device_free):
            return Decision()
        if self.closed:
            batch = self.closed.popleft()
            self.count -= len(batch)
            return self.dispatch(batch, now_ms, "target", self.timeout_ms, self.max_batch, self.max_batch)
        due = self.open_since + self.timeout_ms
        if now_ms >= due:
            batch, self.open = self.open, []
            self.count -= len(batch)
            return self.dispatch(batch, now_ms, "max_wait", self.timeout_ms, self.max_batch, self.max_batch)
        return Decision(wake_at_ms=due)


class PollTimerBatcher(QueuedPolicy):
    """Timer starts when the free worker picks the first request, not at its arrival.

    TorchServe (`batch_size`, `max_batch_delay`; frontend Model.pollBatch, see
    pytorch/serve#2478) and Ray Serve `@serve.batch` (`max_batch_size`,
    `batch_wait_timeout_s`, max_concurrent_batches=1: the wait starts when the
    handler takes the first queued request) both behave this way: a request that
    queued while the worker was busy waits again for the full delay.
    """

    def __init__(self, batch_size: int, max_delay_ms: float, max_inflight: int = 1) -> None:
        super().__init__(max_inflight)
        self.batch_size = batch_size
        self.delay_ms = max_delay_ms
        self.started: float | None = None

    def poll(self, now_ms: float, device_free: bool = True, backlog: int = 0) -> Decision:
        if not self.count or not self.can_run(device_free):
            return Decision()
        if self.started is None:
            self.started = now_ms
        if self.count >= self.batch_size or now_ms >= self.started + self.delay_ms:
            self.started = None
            reason: DispatchReason = "target" if self.count >= self.batch_size else "max_wait"
            return self.dispatch(
                self.take(self.batch_size), now_ms, reason, self.delay_ms, self.batch_size, self.batch_size
            )
        return Decision(wake_at_ms=self.started + self.delay_ms)


class BentoAdaptive(QueuedPolicy):
    """BentoML's adaptive (CORK) dispatcher (marshal/dispatcher.py, docs: adaptive batching).

    Fits batch time = o_a * n + o_b by least squares over the last 50 batches and
    keeps the mean dispatch wait o_w. With the device free it keeps waiting in
    1 ms ticks while n * (newest wait + tick + o_a) <= 0.95 * o_w and the batch is
    below `max_batch_size`. A request whose expected latency (oldest wait + o_a * n
    + o_b) reaches `max_latency_ms` is rejected (answered expired, an SLO miss here).
    Dispatch takes the oldest requests first (BentoML pops newest-first; oldest-first
    is never worse for the tail, so the peer gets it).
    """

    TICK_MS = 1.0
    SAMPLES = 50

    def __init__(self, max_batch_size: int, max_latency_ms: float, max_inflight: int = 1) -> None:
        super().__init__(max_inflight)
        self.max_batch = max_batch_size
        self.max_latency_ms = max_latency_ms
        self.o_a = min(2000.0, max_latency_ms * 2.0 / 30)
        self.o_b = min(1000.0, max_latency_ms / 30)
        self.o_w = 10.0
        self.stats: deque[tuple[int, float, float]] = deque(maxlen=self.SAMPLES)
        self.newest_ms = 0.0
        self.waits: dict[int, float] = {}

    def offer(self, request: PendingRequest, now_ms: float) -> None:
        super().offer(request, now_ms)
        self.newest_ms = request.enqueue_ms

    def poll(self, now_ms: float, device_free: bool = True, backlog: int = 0) -> Decision:
        expired: list[PendingRequest] = []
        queue = self.levels[0]
        while (
            self.count > 1 and (now_ms - queue[0].enqueue_ms) + self.o_a * self.count + self.o_b >= self.max_latency_ms
        ):
            expired.append(queue.popleft())
            self.count -= 1
        if self.count == 1 and now_ms - queue[0].enqueue_ms >= self.max_latency_ms:
            expired.append(queue.popleft())
            self.count -= 1
        if not self.count or not self.can_run(device_free):
            return Decision(expired=expired, wake_at_ms=now_ms + self.TICK_MS if self.count else None)
        n = self.count
        newest_wait = now_ms - self.newest_ms
        if n < self.max_batch and n * (newest_wait + self.TICK_MS + self.o_a) <= 0.95 * self.o_w:
            return Decision(expired=expired, wake_at_ms=now_ms + self.TICK_MS)
        requests = self.take(self.max_batch)
        decision = self.dispatch(
            requests,
            now_ms,
            "target" if len(requests) >= self.max_batch else "max_wait",
            0.0,
            self.max_batch,
            self.max_batch,
        )
        decision.expired = expired
        assert decision.batch is not None
        self.waits[decision.batch.batch_id] = decision.batch.record.oldest_wait_ms
        return decision

    def completed(self, batch: Batch, now_ms: float, compute_ms: float) -> None:
        super().completed(batch, now_ms, compute_ms)
        self.stats.append((batch.size, compute_ms, self.waits.pop(batch.batch_id, 0.0)))
        if len(self.stats) >= 2:
            self._refit()

    def _refit(self) -> None:
        n = len(self.stats)
        sx = sum(s for s, _, _ in self.stats)
        sy = sum(t for _, t, _ in self.stats)
        sxx = sum(s * s for s, _, _ in self.stats)
        sxy = sum(s * t for s, t, _ in self.stats)
        det = n * sxx - sx * sx
        if det > 0:
            slope = (n * sxy - sx * sy) / det
            self.o_a = max(0.001, slope)
            self.o_b = max(0.0, (sy - slope * sx) / n)
        self.o_w = max(0.0, sum(w for _, _, w in self.stats) / n)


class ClipperAIMD(QueuedPolicy):
    """Clipper's adaptive batching (Crankshaw et al., NSDI'17, §4.3).

    Dispatch greedily up to the current batch limit; after each batch, add
    `step` to the limit while the batch ran within the latency objective
    `batch_slo_ms`, and cut it by 10% (multiplicative decrease) when it did not.
    The limit never exceeds `cap`.
    """

    BACKOFF = 0.9

    def __init__(self, batch_slo_ms: float, step: int, cap: int, max_inflight: int = 1) -> None:
        super().__init__(max_inflight)
        self.batch_slo_ms = batch_slo_ms
        self.step = step
        self.cap = cap
        self.limit = float(min(cap, max(1, step)))

    def poll(self, now_ms: float, device_free: bool = True, backlog: int = 0) -> Decision:
        if not self.count or not self.can_run(device_free):
            return Decision()
        limit = int(self.limit)
        reason: DispatchReason = "target" if self.count >= limit else "idle"
        return self.dispatch(self.take(limit), now_ms, reason, 0.0, limit, limit)

    def completed(self, batch: Batch, now_ms: float, compute_ms: float) -> None:
        super().completed(batch, now_ms, compute_ms)
        if compute_ms > self.batch_slo_ms:
            self.limit = max(1.0, self.limit * self.BACKOFF)
        elif batch.size >= int(self.limit):
            self.limit = min(float(self.cap), self.limit + self.step)
