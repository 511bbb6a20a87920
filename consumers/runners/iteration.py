"""Iteration-level (continuous) batching: requests join the running set between decode steps.

With static batches every request waits for the longest one of its batch,
and a batch that formed while the device was busy waits for the whole
previous batch. Here one decode loop owns the device; `run(seqs)` (one call
per batch the engine dispatched, several in flight) queues its sequences as
joiners and returns when all of them finished. The engine still decides who
goes first (tail-marked, then priority, then FIFO): joiners are admitted in
the order their batches were dispatched, never reordered.

When a join pays: a prefill stalls every running row for its duration, and a
lone joiner's prefill costs about three decode steps (SmolLM2 on CPU), so
joiners are admitted as a group: when the running set is empty, when
`JOIN_GROUP` are waiting, when the running set has shrunk to half of what it
was at the last join (rows left: the device has room to fill), or when the
oldest joiner has waited `JOIN_WAIT_STEPS` steps (its time to first token is
bounded). A join whose prompts ride the decode steps in chunks (rows are
decoding and `step_token_budget` is on) stalls nobody: it is admitted at
once. Two bounds keep the running set what the device can hold:

- memory: a joiner is admitted only if every admitted row's prompt plus the
  tokens it may generate still fits the token cap, so the KV cache never
  outgrows what the profile measured (the cap holds at least one longest
  admissible request: a long joiner waits for room, it is never refused);
- time per output token: while the last decode step took longer than the
  step budget (the per-token objective) and the queue is short (fewer than
  `JOIN_GROUP` waiting), nobody joins: a latency budget shapes the set only
  while it costs no throughput. A longer queue joins up to the token cap,
  the throughput knee the profile measured, whatever a step then takes:
  holding it back would make the pipeline slower than its arrivals.

A group whose prompts would spend more than `step_token_budget` tokens in
one prefill while rows are decoding is prefilled in chunks (`chunked_prefill`),
so a long prompt never stalls the running rows for its whole prefill; a
prompt longer than the budget is prefilled alone. With `fused_chunks` each
chunk rides in a decode step's forward pass (`fused_step`), otherwise it is
a forward pass of its own between steps.

A row whose deadline passes stops between steps (answered `expired` with
the text so far), a joiner past its deadline is never prefilled, and a
joiner that could not end by its deadline at the current time per step
(the p75 of the recent answers' lengths x the last step; nobody is judged
before 8 answers ended) is refused at once (`cannot_meet_deadline`).
A deadline bounds compute, not only the wait before dispatch, and at
overload the device serves requests that can still make it instead of
sharing itself among all of them until all expire.

Admission is the shared rule of pipeline/core/engine/joins.py (the
generation bench simulates this loop with it): urgent joiners first, groups
of like prompt lengths (padding at most 1.25x), prompts riding the decode
steps in chunks while rows decode (sized and spaced so that the rides add
RIDE_SHARE of a plain step on average, or with slo_ms_per_new_token the
objective's slack over it: joins.paced_ride, joins.RideCredit), in one
piece when nobody decodes.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.core.engine.joins import (
    JOIN_GROUP,
    JOIN_WAIT_STEPS,
    MIN_CHUNK,
    OLDEST_SHARE,
    Decoding,
    Joiner,
    JoinRule,
    JoinSettings,
    LoopView,
    Waiting,
    late_for_first_token,
    length_groups,
    rides_late,
    rides_ms,
    stall_room,
)
from pipeline.core.engine.shedding import CANNOT_MEET_DEADLINE, CANNOT_MEET_SLO

from .base import Output, describe_error
from .chunked_prefill import ChunkedPrefill, ChunkPacer, RidePacer, riders
from .decoding import RunningSet, Sequence, drop_expired
from .fused_step import ride, supported

JOIN_SLOTS = 2 * JOIN_GROUP
"""In-flight batches beyond what the running set holds: joiners queued for room, so that
rows leaving at the token cap are replaced in groups rather than one prefill at a time."""

TIMED_KEPT = 1024
"""Timed steps kept for the consumer at most (it takes them every beacon; a stale one is worth nothing)."""


def running_token_cap(batch_cap: int | None, slots: int, target: int | None = None) -> int | None:
    """Tokens the running set may reserve: every in-flight batch but the joiners' slots, each at
    the target size (the request the running set was sized for; the cap when none is set), and
    never less than one batch at the cap, so the longest request a batch may hold can join."""
    if batch_cap is None:
        return None
    return max(batch_cap, (target or batch_cap) * max(1, slots - JOIN_SLOTS))


@dataclass(eq=False)
class _Group:
    """The sequences of one `run()` call: done when the last of them finishes."""

    seqs: list[Sequence]
    arrived_step: int
    remaining: int = 0
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def finish(self, count: int = 1) -> None:
        self.remaining -= count
        if self.remaining <= 0:
            self.done.set()


class IterationScheduler:
    """One decode loop (a thread) over a running set that batches join between steps."""

    def __init__(
        self,
        new_running: Callable[[], RunningSet],
        to_output: Callable[[Sequence], Output],
        *,
        token_cap: int | None = None,
        step_budget_ms: float | None = None,
        join_group: int = JOIN_GROUP,
        join_wait_steps: int = JOIN_WAIT_STEPS,
        step_token_budget: int = 0,
        tpot_ms: float | None = None,
        refuse_hopeless: bool = True,
        fused_chunks: bool = True,
    ) -> None:
        self._new_running = new_running
        self._to_output = to_output
        self.token_cap = token_cap
        self.step_budget_ms = step_budget_ms
        self._last_step_ms = 0.0
        self.step_token_budget = step_token_budget
        self.fused_chunks = fused_chunks
        self._pacer = RidePacer(step_token_budget, tpot_ms) if fused_chunks else ChunkPacer(step_token_budget)
        self._rule = JoinRule(
            JoinSettings(
                token_cap, step_budget_ms, join_group, join_wait_steps, tpot_ms, step_token_budget, refuse_hopeless
            )
        )
        self._running = new_running()
        self._joiners: deque[Sequence] = deque()
        self._prefills: deque[ChunkedPrefill] = deque()
        """Admitted groups whose prompts are prefilled in chunks between steps (the head advances)."""
        self._cond = threading.Condition()
        self._closed = False
        self._size_at_join = 0
        self.steps = 0
        """Decode steps run so far."""
        self.joins = 0
        """Prefills (groups admitted) so far."""
        self.chunks = 0
        """Chunks of chunked prefills so far (forward passes of their own, or riding in a step)."""
        self._timed: deque[tuple[int, float]] = deque(maxlen=TIMED_KEPT)
        """Plain decode steps (rows, ms) not yet taken by `timed_steps`."""
        self._thread = threading.Thread(target=self._loop, name="batchtide-decode", daemon=True)
        self._thread.start()

    def run(self, seqs: list[Sequence]) -> list[Output]:
        """Queue `seqs` to join the running set; block until every one finished."""
        if not seqs:
            return []
        with self._cond:
            if self._closed:
                raise RuntimeError("the decode loop is closed")
            group = _Group(seqs, self.steps, remaining=len(seqs))
            for seq in seqs:
                seq.tag = group
            self._joiners.extend(seqs)
            self._cond.notify()
        group.done.wait()
        if group.error is not None:
            raise RuntimeError(group.error)
        return [self._to_output(s) for s in seqs]

    def timed_steps(self) -> list[tuple[int, float]]:
        """The plain decode steps (rows, ms) timed since the last call, oldest first: the consumer's
        balance learns its pace from them as they run (`decode_pace`)."""
        taken: list[tuple[int, float]] = []
        while self._timed:
            taken.append(self._timed.popleft())
        return taken

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _drop_expired(self, now_ms: float) -> list[Sequence]:
        """Joiners whose deadline passed while they waited, those the join rule refuses as hopeless
        (`cannot_meet_deadline`), and queued prompts not yet started and joiners whose first token
        cannot come in time (`cannot_meet_slo`): they leave without a prefill."""
        expired = [s for s in self._joiners if s.deadline_ms is not None and s.deadline_ms <= now_ms]
        drop_expired(expired, now_ms)
        waiting = [s for s in self._joiners if not s.finished]
        refused = [waiting[k] for k in self._rule.refused(self._views(waiting), self._view(), now_ms)]
        for seq in refused:
            seq.finished = seq.expired = True
            seq.refused = CANNOT_MEET_DEADLINE
        late = self._late_for_first_token([s for s in waiting if not s.finished], now_ms)
        if expired or refused or late:
            self._joiners = deque(s for s in self._joiners if not s.finished)
        return expired + refused + late

    def _late_for_first_token(self, waiting: list[Sequence], now_ms: float) -> list[Sequence]:
        """The queued prompts not yet started and the joiners (in the order the loop serves them) whose
        first token could not come by its time even prefilled back to back at the measured price per
        prompt token (joins.late_for_first_token), stopped `cannot_meet_slo`."""
        cost = self._pacer.cost()
        queued = [p for p in self._prefills if any(s.first_token_by_ms is not None for s in p.seqs)]
        if cost is None or not (queued or any(s.first_token_by_ms is not None for s in waiting)):
            return []
        order = sorted(waiting, key=lambda s: s.priority)  # the rule admits urgent joiners first
        items = [
            Waiting(min((s.first_token_by_ms or math.inf) for s in p.seqs), p.remaining_tokens, p.chunks > 0)
            for p in self._prefills
        ] + [Waiting(s.first_token_by_ms, len(s.prompt), False) for s in order]
        prefills = list(self._prefills)
        late: list[Sequence] = []
        for k in late_for_first_token(items, now_ms, cost[1]):
            seqs = prefills[k].seqs if k < len(prefills) else [order[k - len(prefills)]]
            if k < len(prefills):
                self._prefills.remove(prefills[k])
            for seq in seqs:
                seq.finished = seq.expired = True
                seq.refused = CANNOT_MEET_SLO
                seq.last_token_ms = now_ms
            late += seqs
        return late

    @property
    def _prefilling_tokens(self) -> int:
        return sum(p.reserved_tokens for p in self._prefills)

    def _view(self) -> LoopView:
        reserved = self._running.reserved_tokens + self._prefilling_tokens
        return LoopView(len(self._running), reserved, self._last_step_ms, self.steps, self._size_at_join)

    @staticmethod
    def _views(seqs: list[Sequence]) -> list[Joiner]:
        return [
            Joiner(len(s.prompt), s.reserved_tokens, s.limit, s.deadline_ms, s.priority, s.tag.arrived_step)
            for s in seqs
        ]

    def _admit(self, now_ms: float) -> list[Sequence]:
        """Joiners to prefill now (urgent first, then in dispatch order), or none yet (joins.py)."""
        joiners = list(self._joiners)
        chosen = [joiners[k] for k in self._rule.admit(self._views(joiners), self._view(), now_ms)]
        if chosen:
            taken = set(map(id, chosen))
            self._joiners = deque(s for s in joiners if id(s) not in taken)
        return chosen

    def _loop(self) -> None:
        import torch

        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._closed and not self._joiners and not self._busy:
                        self._cond.wait()
                    if self._closed and not self._joiners and not self._busy:
                        return
                    now = time.time() * 1000.0
                    finished: list[Sequence] = self._drop_expired(now)
                    joining = self._admit(now)
                try:
                    finished += self._running.expire(now)
                    if joining:
                        self.joins += 1
                        finished += self._join(joining, now)
                    finished += self._step(now)
                except Exception as e:
                    failing = self._running.live + joining + [s for p in self._prefills for s in p.seqs]
                    self._finish([s for s in finished if s not in failing])
                    self._fail(failing, describe_error(e))
                    continue
                self._finish(finished)

    @property
    def _busy(self) -> bool:
        return bool(len(self._running) or self._prefills)

    def _room(self, now_ms: float) -> tuple[float, float]:
        """The decoding rows' room for a stall and what they banked (joins.stall_room), less what the
        rides owe; (0, 0) unless rides are paced by a time-per-output-token objective."""
        pacer = self._pacer
        if not isinstance(pacer, RidePacer) or pacer.tpot_ms is None or not len(self._running):
            return 0.0, 0.0
        rule = self._rule
        rows = [
            Decoding(
                s.first_token_ms or now_ms,
                len(s.generated),
                rule.remaining_tokens(len(s.generated), s.limit, s.ignore_eos),
            )
            for s in self._running.live
        ]
        room, banked = stall_room(rows, now_ms, self._last_step_ms, pacer.tpot_ms)
        return room - pacer.owed_ms, banked

    def _join(self, joining: list[Sequence], now_ms: float) -> list[Sequence]:
        """Prefill the admitted joiners in groups of like prompt lengths: while rows decode a group
        rides the decode steps in chunks, one prompt at a time (a ride pays no padding), unless no
        group is queued to ride and its stall fits the rows' room (JoinRule.stall_fits); with nobody
        decoding it is prefilled in one piece (joins.py)."""
        finished: list[Sequence] = []
        decoding = len(self._running)
        room, banked = self._room(now_ms)
        stalled = 0.0
        pacer = self._pacer
        pace = pacer.ride_pace(decoding, self._last_step_ms) if isinstance(pacer, RidePacer) and room > 0 else None
        for members in length_groups([len(s.prompt) for s in joining]):
            group = [joining[k] for k in members]
            width = max(len(s.prompt) for s in group)
            expected = pacer.stall_ms(len(group) * width) if pace is not None and isinstance(pacer, RidePacer) else None
            slow = rides_ms(sum(len(s.prompt) for s in group), *pace) if pace is not None else 0.0
            at_once = self._rule.one_piece(decoding) or (
                expected is not None and self._rule.stall_fits(stalled + expected, room, len(self._prefills), slow)
            )
            if not at_once:
                self._prefills.extend(ChunkedPrefill(self._running, [s]) for s in group)
            else:
                started = time.perf_counter()
                finished += self._running.join(group)
                ms = (time.perf_counter() - started) * 1000.0
                self._pacer.observe(len(group) * width, ms)
                stalled += ms
                self._size_at_join = len(self._running)
        if stalled and decoding and isinstance(self._pacer, RidePacer):
            self._pacer.stalled(stalled, banked)
        return finished

    def _rescue(self, prefill: ChunkedPrefill, now_ms: float) -> bool:
        """Whether the oldest queued prompt, late for its first token at the rides' pace (joins.rides_late),
        has its rest prefilled in one piece now (JoinRule.rescue)."""
        pacer = self._pacer
        by = min((s.first_token_by_ms for s in prefill.seqs if s.first_token_by_ms is not None), default=None)
        if by is None or not isinstance(pacer, RidePacer) or pacer.tpot_ms is None:
            return False
        share = OLDEST_SHARE if len(self._prefills) > 1 else 1.0
        pace = pacer.ride_pace(len(self._running), self._last_step_ms, share)
        expected = pacer.stall_ms(prefill.remaining_tokens)
        if pace is None or expected is None or not rides_late(prefill.remaining_tokens, *pace, now_ms, by):
            return False
        room, _ = self._room(now_ms)
        return self._rule.rescue(expected, room, now_ms, by)

    def _step(self, now_ms: float) -> list[Sequence]:
        """A chunk of the oldest queued prefill, then a decode step of the running rows (one forward
        pass when the chunk rode in the step); `_last_step_ms` times plain steps only."""
        finished, stepped = self._advance_prefill(now_ms)
        if len(self._running) and not stepped:
            rows = len(self._running)
            started = time.perf_counter()
            finished += self._running.step()
            self._last_step_ms = (time.perf_counter() - started) * 1000.0
            self._timed.append((rows, self._last_step_ms))
            self.steps += 1
            if isinstance(self._pacer, RidePacer):
                self._pacer.observe_plain(self._last_step_ms)
        return finished

    def _advance_prefill(self, now_ms: float) -> tuple[list[Sequence], bool]:
        """One chunk of the oldest queued prefill (all of it when no row is decoding), or with fused
        chunks a ride in the decode step, when one is due (`RidePacer.due`), that spends its tokens
        over the queue (joins.ride_plan); a group complete is merged into the running set, a group
        whose every deadline passed is dropped. Returns the finished rows and whether the step ran."""
        finished: list[Sequence] = []
        stepped = False
        while self._prefills:
            prefill = self._prefills[0]
            if all(s.deadline_ms is not None and s.deadline_ms <= now_ms for s in prefill.seqs):
                self._prefills.popleft()
                drop_expired(prefill.seqs, now_ms)
                finished += prefill.seqs
                continue
            decoding = len(self._running)
            pacer = self._pacer
            if decoding and self._rescue(prefill, now_ms):
                _, banked = self._room(now_ms)
                started = time.perf_counter()
                fed = prefill.advance(None)
                ms = (time.perf_counter() - started) * 1000.0
                pacer.observe(fed, ms)
                if isinstance(pacer, RidePacer):
                    pacer.stalled(ms, banked)
                self.chunks += 1
                self._prefills.popleft()
                finished += prefill.admit()
                self._size_at_join = len(self._running)
                break
            rides = pacer if isinstance(pacer, RidePacer) and decoding and supported(self._running.model) else None
            if rides is not None and not rides.due(self._last_step_ms):
                return finished, False  # the last rides' time is paid back by a plain step first
            started = time.perf_counter()
            tokens = pacer.tokens(decoding, self._last_step_ms) if decoding else None
            stepped = rides is not None
            if rides is not None:
                riding = riders(list(self._prefills), tokens or MIN_CHUNK)
                done, fed = ride(self._running, riding)
                finished += done
                rides.observe_ride(fed, (time.perf_counter() - started) * 1000.0, self._last_step_ms)
                self.steps += 1
                for later, _ in riding[1:]:  # groups behind the oldest that rode to their end
                    if later.complete:
                        self._prefills.remove(later)
                        finished += later.admit()
                        self._size_at_join = len(self._running)
            else:
                fed = prefill.advance(tokens)
                pacer.observe(fed, (time.perf_counter() - started) * 1000.0)
            self.chunks += 1
            if not prefill.complete:
                break
            self._prefills.popleft()
            finished += prefill.admit()
            self._size_at_join = len(self._running)
            if decoding:
                break
        return finished, stepped

    def _finish(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._learn(seq)
            seq.tag.finish()

    def _learn(self, seq: Sequence) -> None:
        """An answer that ended by itself tells the join rule how long answers run."""
        if not seq.expired:
            self._rule.learn(len(seq.generated))

    def _fail(self, seqs: list[Sequence], error: str) -> None:
        """A step or prefill raised: the rows it held fail (the caller bisects), the set restarts."""
        self._running = self._new_running()
        self._prefills.clear()
        self._size_at_join = 0
        failed = {id(s.tag): s.tag for s in seqs}
        with self._cond:
            self._joiners = deque(s for s in self._joiners if id(s.tag) not in failed)
        for group in failed.values():
            group.error = error
            group.done.set()
