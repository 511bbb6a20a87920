"""Share mode's pull rule for a slow member: take only the records it answers within a faster peer's tail.

In a share group a member pulls while its device has a free slot, so the
group splits the load by pull rate: a 3x slower member takes about a
quarter of a pair's requests, and every one of them runs in its slower
batches. Its share is far above 1%, so the group's p99 is its tail. Load
balanced, latency not.

A member that is clearly slower than its fastest peer (its capacity at
most `slower_share` of that peer's, both from the learned t(b)) takes a
record only when it answers it within the tail a peer would give it, judged
on the record's age. A peer that pulls whenever its device frees answers
its latest record about two of its batch times (`tail_batches`) after the
record arrived, so that is the budget; and a peer's beacon says when one of
its polls last left the broker empty (`drained_at_ms`, sent at once), so
nothing that waits there now is older than that. The slow member pulls the
largest n with (now - that drain) + t(n) within the budget: small batches
of young records while its peers keep up, nothing once what waits is too
old for its slower batches (its peers take those next, and sooner).

The age matters because records are delivered oldest first: judged on
the peers' finish times alone (their start time, aged with the beacon as
in `peer_forwarding.peer_finish_ms`, plus their recent batch time), a slow
member pulled whenever a beacon up to an interval old made a peer look
busy, and took the oldest records it could; in the simulator of
tests/engine/test_share_pull.py (100 ms beacons, one of two devices 3x
slower) the group's p99 came out about 10% higher that way. That
comparison remains for a peer that has not left the broker empty within
the budget (it is behind its load, its next pull will not reach what
waits) or whose beacon does not say: then the slow member takes the batch
it finishes no later than that peer would finish a record left now. There
is no forwarding hop: what the slow member does not pull was never its own.

Restraint needs evidence, because a restrained member is measured only
when it pulls, so a wrong restraint would feed itself. Both sides must
have measured `min_batches` batches (a t(b) learned from a few, at a cold
start or through a hiccup under CPU contention, can be off by more than
the margin, and twins must never starve each other), and a restrained
member whose newest batch is older than `remeasure_ms` may take one unit,
so that its speed is measured again even when its peers are never busy
enough to make it pull: a twin misread as slow, or a slow device that
recovered, then learns its true t(b) and is released.

A member that has measured nothing, or whose peers' beacons are all older
than `stale_ms` (a peer gone) or have measured too little, pulls as
before: nobody is known to be faster.

Pure: no clock, no Kafka. The consumer feeds it its learned t(b) and its
peers' beacons; tests feed it virtual ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeline.core.engine.peer_forwarding import ForwardRule, MemberView, peer_finish_ms

DEFAULT_SLOWER_SHARE = 0.6
"""A member whose capacity is at most this share of its fastest peer's is restrained. Learned
capacities under CPU contention differ by tens of percent between twins (the same bound as
forwarding's `relief_load`), and a 3x slower device is at 0.33."""
DEFAULT_TAIL_BATCHES = 2.0
"""A peer that pulls whenever its device frees answers its latest record about two batch times
after it arrived (it waits out the batch running, then runs in the next): that is the tail a
slow member's records must not pass."""
DEFAULT_MIN_BATCHES = 8
"""Batches a capacity rests on before it restrains or is restrained: a handful at the smallest
sizes leaves t(b) at the knee an extrapolation."""
DEFAULT_REMEASURE_MS = 1000.0
"""A restrained member takes one unit after this long without a batch: at a few hundred records
a second, one in hundreds runs at the slow speed, far from the group's p99."""


@dataclass(frozen=True)
class PullRule:
    slower_share: float = DEFAULT_SLOWER_SHARE
    min_batches: int = DEFAULT_MIN_BATCHES
    """Batches each side must have measured before their capacities are compared."""
    remeasure_ms: float = DEFAULT_REMEASURE_MS
    """A restrained member whose newest measured batch is older than this may take one unit."""
    stale_ms: float = 2000.0
    """A beacon older than this is a peer that may be gone: it is not counted on."""
    phase_share: float = 0.5
    """A peer's start time ages with its beacon down to this share of its batch time, no lower."""
    tail_batches: float = DEFAULT_TAIL_BATCHES
    """A slow member's record must be answered within this many of a faster peer's batch times."""


@dataclass(frozen=True)
class Pull:
    """What a member with a free device slot may pull now."""

    units: int
    """Cost units the next poll may bring (the batch it would run, with what waits already)."""
    restrained: bool
    """A faster peer decided the bound: a fresh beacon can change it."""


def peer_wait_ms(peer: MemberView, now_ms: float, rule: PullRule) -> float:
    """When `peer` would finish a record left on the broker now: it pulls once a slot frees and
    runs the record in a batch like its recent ones (no hop: it fetches the record itself)."""
    forward_rule = ForwardRule(hop_ms=0.0, phase_share=rule.phase_share)
    return peer_finish_ms(peer, 0, forward_rule, age_ms=max(0.0, now_ms - peer.at_ms))


def measured(peer: MemberView, now_ms: float, rule: PullRule) -> bool:
    """A peer whose beacon is fresh and rests on `min_batches` batches: evidence for the rule."""
    return peer.capacity_per_s > 0 and now_ms - peer.at_ms <= rule.stale_ms and (peer.batches or 0) >= rule.min_batches


def clearly_faster(fast: tuple[float, float | None], slow: tuple[float, float], rule: PullRule) -> bool:
    """A member of (capacity/s, t(1) ms) `fast` outpaces one of `slow` by the margin on both. The capacity is
    the throughput at the largest batch a member measured (the curve is extrapolated in proportion
    past it), so it follows the member's load: a lightly loaded twin that has run only small
    batches reads a fraction of the capacity of one that once ran a larger batch. t(1) does not
    depend on the load, and a slower device is slower at both."""
    (fast_capacity, fast_unit), (slow_capacity, slow_unit) = fast, slow
    return (
        slow_capacity <= rule.slower_share * fast_capacity
        and fast_unit is not None
        and 0 < fast_unit <= rule.slower_share * slow_unit
    )


def outpaces_a_peer(
    capacity_per_s: float,
    unit_ms: float | None,
    batches: int,
    peers: Sequence[MemberView],
    now_ms: float,
    rule: PullRule,
) -> bool:
    """Whether a fresh peer would be restrained against this member (the margin, on evidence from
    both): only then is a poll that left the broker empty worth a beacon at once. In a group of
    equals such beacons would only load the cores that serve (live, a group of eight equal
    consumers on two cores that sent one per drained poll fell behind its load)."""
    if capacity_per_s <= 0 or unit_ms is None or batches < rule.min_batches:
        return False
    return any(
        measured(p, now_ms, rule)
        and p.unit_ms is not None
        and clearly_faster((capacity_per_s, unit_ms), (p.capacity_per_s, p.unit_ms), rule)
        for p in peers
    )


def largest_within(t_ms: Callable[[int], float], ceiling: int, budget_ms: float) -> int:
    """The largest n <= ceiling with t(n) <= budget_ms (t grows with n), 0 when none."""
    low, high = 0, ceiling
    while low < high:
        mid = (low + high + 1) // 2
        if t_ms(mid) <= budget_ms:
            low = mid
        else:
            high = mid - 1
    return low


def pull_bound(
    t_ms: Callable[[int], float] | None,
    capacity_per_s: float,
    ceiling: int,
    peers: Sequence[MemberView],
    now_ms: float,
    rule: PullRule,
    *,
    batches: int,
    measured_at_ms: float | None,
) -> Pull:
    """How many cost units a member may run in its next batch, with its device free.

    `t_ms`: its learned t(b), None before it measured a batch; `capacity_per_s`: its capacity at
    the knee (`peer_forwarding.capacity_per_s`); `ceiling`: its largest batch; `batches`: the
    batches it measured, the newest ending at `measured_at_ms`. Unrestrained, the bound is the
    ceiling; restrained, the largest n whose t(n) fits the budget the module's docstring gives
    (the tail budget less the age of what waits, or the soonest peer's finish time), 0 when even
    one unit does not fit, and 1 then when its own measure is older than `rule.remeasure_ms`."""
    free = Pull(ceiling, restrained=False)
    if t_ms is None or capacity_per_s <= 0 or batches < rule.min_batches:
        return free
    known = [p for p in peers if measured(p, now_ms, rule)]
    mine = (capacity_per_s, t_ms(1))
    faster = [p for p in known if clearly_faster((p.capacity_per_s, p.unit_ms), mine, rule)]
    if not faster:
        return free
    drains = [p.drained_at_ms for p in known if p.drained_at_ms is not None]
    allowance = rule.tail_batches * min(p.batch_ms for p in faster)
    age = max(0.0, now_ms - max(drains)) if drains else math.inf
    if age <= allowance:
        low = largest_within(t_ms, ceiling, allowance - age)
    else:
        low = largest_within(t_ms, ceiling, min(peer_wait_ms(p, now_ms, rule) for p in faster))
    if low == 0 and (measured_at_ms is None or now_ms - measured_at_ms >= rule.remeasure_ms):
        low = min(1, ceiling)
    return Pull(low, restrained=True)
