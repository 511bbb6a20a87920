"""Share mode's pull rule for a slow member: take a record only where it finishes no later than at a peer.

In a share group a member pulls while its device has a free slot, so the
group splits the load by pull rate: a 3x slower member takes about a
quarter of a pair's requests, and every one of them runs in its slower
batches. Its share is far above 1%, so the group's p99 is its tail. Load
balanced, latency not.

A member that is clearly slower than its fastest peer (its capacity at
most `slower_share` of that peer's, both from the learned t(b): noise
between twins never restrains either) pulls only as many cost units as it
can run no later than a record left on the broker would be finished by a
peer: its own t(n) on its free device against the peer's start time (busy
time left, aged with the beacon as in `peer_forwarding.peer_finish_ms`)
plus the peer's recent batch time. When the peers are busy enough that a
record would wait for them longer than the slow device takes, the slow
member helps, with small batches; when a peer would finish it sooner, the
record stays on the broker for that peer. There is no forwarding hop:
what the slow member does not pull was never its own.

A member that has measured nothing, or whose peers' beacons are all older
than `stale_ms` (a peer gone) or have measured nothing, pulls as before:
nobody is known to be faster. A slow member that recovers is measured
again only when it pulls, which it does as soon as the peers' load makes
a record wait for them as long as the member's learned t(1).

Pure: no clock, no Kafka. The consumer feeds it its learned t(b) and its
peers' beacons; tests feed it virtual ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeline.core.engine.peer_forwarding import ForwardRule, MemberView, peer_finish_ms

DEFAULT_SLOWER_SHARE = 0.6
"""A member whose capacity is at most this share of its fastest peer's is restrained. Learned
capacities under CPU contention differ by tens of percent between twins (the same bound as
forwarding's `relief_load`), and a 3x slower device is at 0.33."""


@dataclass(frozen=True)
class PullRule:
    slower_share: float = DEFAULT_SLOWER_SHARE
    stale_ms: float = 2000.0
    """A beacon older than this is a peer that may be gone: it is not counted on."""
    phase_share: float = 0.5
    """A peer's start time ages with its beacon down to this share of its batch time, no lower."""


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


def pull_bound(
    t_ms: Callable[[int], float] | None,
    capacity_per_s: float,
    ceiling: int,
    peers: Sequence[MemberView],
    now_ms: float,
    rule: PullRule,
) -> Pull:
    """How many cost units a member may run in its next batch, with its device free.

    `t_ms`: its learned t(b), None before it measured a batch; `capacity_per_s`: its capacity at
    the knee (`peer_forwarding.capacity_per_s`); `ceiling`: its largest batch. Unrestrained, the
    bound is the ceiling; restrained, the largest n with t(n) no later than the soonest peer
    would finish the record, 0 when even one unit would finish later."""
    free = Pull(ceiling, restrained=False)
    if t_ms is None or capacity_per_s <= 0:
        return free
    fresh = [p for p in peers if p.capacity_per_s > 0 and now_ms - p.at_ms <= rule.stale_ms]
    if not fresh or capacity_per_s > rule.slower_share * max(p.capacity_per_s for p in fresh):
        return free
    wait = min(peer_wait_ms(p, now_ms, rule) for p in fresh)
    low, high = 0, ceiling
    while low < high:  # t(n) grows with n: the largest n with t(n) <= wait
        mid = (low + high + 1) // 2
        if t_ms(mid) <= wait:
            low = mid
        else:
            high = mid - 1
    return Pull(low, restrained=True)
