"""Self-fencing: a transaction commits offsets only while this consumer's group membership is fresh.

aiokafka (0.14) sends `send_offsets_to_transaction` as TxnOffsetCommit v0,
which carries no generation or member id, so the broker cannot refuse the
offsets of a member it has already expelled (KIP-447 added those fields in
v3, apache/kafka#7897; kafka-python added them in dpkp/kafka-python#2984,
aiokafka has not). The consumer's producer now sends v3 with `member`
(`pipeline.core.kafka.txn_offset_commit`), so the coordinator refuses such
offsets; this guard stays the first line: it also aborts before anything
is asked, and catches a generation that moved while the offsets were sent.

When a group coordinator freezes for longer than the session timeout, the group
can expel a member that does not know it yet; that member's next
transaction would still commit its answers and their offsets while the
partition's new owner answers the same records again.

So the consumer fences itself. `MembershipGuard` remembers when a heartbeat
last succeeded (the time it was sent, with the generation it carried) by
wrapping aiokafka's coordinator heartbeat, and a join counts as one. A
transaction that carries offsets commits only if that heartbeat is younger
than `FRESH_FRACTION` of the session timeout and the generation is still
the one its batches were published under (`stale`). The coordinator cannot
have expelled a member within a session timeout of a heartbeat it
accepted, so the margin left (half a session, 5 s by default) covers the
commit itself. What it does not cover is written in docs/kafka.md.
"""

from __future__ import annotations

from typing import Any

from aiokafka import AIOKafkaConsumer

from consumers.clock import Clock
from pipeline.core.kafka.txn_offset_commit import GroupMember

FRESH_FRACTION = 0.5
"""A heartbeat older than this share of the session timeout makes the membership stale."""
SELF_FENCED = "self-fenced:"
"""Starts every log line of a transaction aborted or a commit skipped here (the chaos rows count them)."""
LEFT_FOR_OWNERS = "self-fenced: records left"
"""Starts the log line of a transaction given up because the generation moved."""
NO_GENERATION = -1
"""aiokafka's generation while it is not a member (never joined, or reset after an expulsion)."""


def stale(
    now_s: float,
    heartbeat_s: float | None,
    heartbeat_generation: int,
    generation_now: int,
    generation_then: int,
    session_s: float,
    fraction: float = FRESH_FRACTION,
) -> str | None:
    """Why offsets must not be committed now (None: they may): the rule, on plain numbers."""
    if generation_now == NO_GENERATION or generation_now != generation_then:
        return f"the group generation moved from {generation_then} to {generation_now}"
    if heartbeat_s is None or heartbeat_generation != generation_now:
        return f"no heartbeat accepted in generation {generation_now} yet"
    age = now_s - heartbeat_s
    if age > fraction * session_s:
        return f"the last accepted heartbeat is {age:.1f} s old (session timeout {session_s:.0f} s)"
    return None


class MembershipGuard:
    """The generation and last accepted heartbeat of one consumer's group membership."""

    def __init__(self, clock: Clock, session_s: float = 10.0) -> None:
        self._clock = clock
        self.session_s = session_s
        self._coordinator: Any = None
        self._heartbeat: tuple[float, int] | None = None
        """(monotonic s when sent, generation) of the last heartbeat the coordinator accepted."""

    def attach(self, consumer: AIOKafkaConsumer) -> None:
        """Watch a started consumer's heartbeats (aiokafka exposes neither them nor the generation)."""
        coordinator = self._coordinator = consumer._coordinator
        self.session_s = coordinator._session_timeout_ms / 1000.0
        beat = coordinator._do_heartbeat

        async def watched_heartbeat() -> bool:
            sent_s, generation = self._clock.monotonic_s(), coordinator.generation
            accepted: bool = await beat()
            if accepted:
                self._heartbeat = (sent_s, generation)
            return accepted

        coordinator._do_heartbeat = watched_heartbeat

    @property
    def generation(self) -> int:
        return NO_GENERATION if self._coordinator is None else int(self._coordinator.generation)

    def member(self) -> GroupMember:
        """Who this consumer is in its group now, for the broker to check a transaction's offsets against."""
        coordinator = self._coordinator
        if coordinator is None:
            return GroupMember(NO_GENERATION, "")
        return GroupMember(int(coordinator.generation), str(coordinator.member_id), coordinator._group_instance_id)

    def joined(self) -> None:
        """The group just assigned partitions: the join confirms membership like a heartbeat."""
        self._heartbeat = (self._clock.monotonic_s(), self.generation)

    def stale(self, generation_then: int) -> str | None:
        beat_s, beat_generation = self._heartbeat or (None, NO_GENERATION)
        return stale(
            self._clock.monotonic_s(), beat_s, beat_generation, self.generation, generation_then, self.session_s
        )
