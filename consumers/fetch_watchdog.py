"""Un-sticking a fetch that waits on a broker that stopped answering.

When a broker is frozen (SIGSTOP, a long GC pause, a network partition that
keeps TCP up) while it leads some of a consumer's partitions, aiokafka's
fetch to it has no answer until `request_timeout_ms` runs out, and once the
broker thaws the connection can stay quiet longer still: in the cluster's
`broker-freeze` row a request partition stopped being consumed for over
90 s after the freeze, while its new leader had the records and the other
partitions flowed. Nothing in aiokafka notices, because the connection is
neither closed nor timed out in time.

The watchdog looks every `CHECK_S`: a partition that is assigned, not
paused (backpressure), has records to read (the log's end, read_committed,
is past the fetch position) and whose position has not moved for `STALL_S`
is stalled. The first remedy is a forced metadata refresh (the leader may
have moved); if the partition is still stalled `STALL_S / 2` later, the
client's fetch connections to its leaders, old and new, are closed, which
fails the fetch in flight so aiokafka reconnects and fetches again from the
current leader. Each such close counts in `ConsumerStats.fetch_stalls_unblocked`.
When the end offsets get no answer within `ASK_TIMEOUT_S` (their leader is
the broker that stopped answering, or the machine is very busy) the watchdog
only refreshes metadata and starts a new period: it never closes
connections on a guess.

The decisions (`StallTracker`) take positions and times as arguments, so they
are tested without a broker; `FetchWatchdog` is the shell that asks aiokafka.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.client import ConnectionGroup
from aiokafka.conn import CloseReason

from consumers.clock import Clock
from consumers.stats import ConsumerStats

log = logging.getLogger("batchtide.consumer.fetch_watchdog")

STALL_S = 6.0
"""A partition with records to read whose position has not moved this long is stalled."""
CHECK_S = 1.5
"""How often the watchdog looks."""
UNBLOCKED = "fetch watchdog: unblocked"
"""How the log line of each unblock begins (the chaos rows count them in the consumers' logs)."""
REFRESHED = "fetch watchdog: stalled"
ASK_TIMEOUT_S = 3.0
"""One question to the broker (end offsets, metadata) gives up after this: a frozen broker never answers."""


@dataclass(frozen=True)
class Remedy:
    """What to do for the partitions that are stalled now: refresh metadata, or reconnect."""

    refresh: frozenset[TopicPartition] = frozenset()
    reconnect: frozenset[TopicPartition] = frozenset()


class StallTracker:
    """Which partitions are stalled, and which remedy each is due (pure: positions and time come in)."""

    def __init__(self, stall_s: float = STALL_S) -> None:
        self.stall_s = stall_s
        self._moved: dict[TopicPartition, tuple[int | None, float]] = {}
        self._refreshed: dict[TopicPartition, float] = {}

    def observe(self, positions: Mapping[TopicPartition, int | None], now_s: float) -> list[TopicPartition]:
        """Record positions of the partitions being fetched now; those unmoved for `stall_s` (suspects)."""
        for tp in list(self._moved):
            if tp not in positions:
                self._forget(tp)
        suspects = []
        for tp, position in positions.items():
            seen = self._moved.get(tp)
            if seen is None or seen[0] != position:
                self._moved[tp] = (position, now_s)
                self._refreshed.pop(tp, None)
            elif now_s - seen[1] >= self.stall_s:
                suspects.append(tp)
        return suspects

    def remedy(self, stalled: Iterable[TopicPartition], now_s: float) -> Remedy:
        """The remedy due for each stalled partition: a refresh first, a reconnect if the refresh did not help."""
        refresh, reconnect = set(), set()
        for tp in stalled:
            refreshed = self._refreshed.get(tp)
            if refreshed is None:
                refresh.add(tp)
                self._refreshed[tp] = now_s
            elif now_s - refreshed >= self.stall_s / 2:
                reconnect.add(tp)
                position = self._moved[tp][0]
                self._moved[tp] = (position, now_s)  # a fresh stall period before the next remedy
                self._refreshed.pop(tp, None)
        return Remedy(frozenset(refresh), frozenset(reconnect))

    def idle(self, tps: Iterable[TopicPartition], now_s: float) -> None:
        """These suspects have nothing to read: their wait starts again."""
        for tp in tps:
            self._moved[tp] = (self._moved[tp][0], now_s)
            self._refreshed.pop(tp, None)

    def _forget(self, tp: TopicPartition) -> None:
        self._moved.pop(tp, None)
        self._refreshed.pop(tp, None)


class FetchWatchdog:
    """Watches one aiokafka consumer's fetch positions and un-sticks stalled partitions."""

    def __init__(
        self, consumer: AIOKafkaConsumer, stats: ConsumerStats, clock: Clock, stall_s: float = STALL_S
    ) -> None:
        self._consumer = consumer
        self._stats = stats
        self._clock = clock
        self._tracker = StallTracker(stall_s)
        self._leaders: dict[TopicPartition, int] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fetch-watchdog")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            try:
                await self.check()
            except Exception as e:
                log.warning("fetch watchdog: look skipped: %r", e)

    async def check(self) -> None:
        consumer, now = self._consumer, self._clock.monotonic_s()
        paused = consumer.paused()
        fetching = [tp for tp in consumer.assignment() if tp not in paused]
        positions = {tp: self._position(tp) for tp in fetching}
        suspects = self._tracker.observe(positions, now)
        for tp in fetching:  # the leader a partition was fetched from while it moved
            leader = consumer._client.cluster.leader_for_partition(tp)
            if tp not in suspects and leader is not None and leader >= 0:
                self._leaders[tp] = leader
        for tp in set(self._leaders) - set(fetching):
            del self._leaders[tp]
        if not suspects:
            return
        stalled = await self._with_records(suspects, positions)
        if stalled is None:  # no answer on the end offsets: refresh, but never reconnect on a guess
            self._tracker.idle(suspects, now)
            await self._refresh(suspects, "no answer on their end offsets")
            return
        self._tracker.idle([tp for tp in suspects if tp not in stalled], now)
        remedy = self._tracker.remedy(stalled, now)
        if remedy.refresh:
            await self._refresh(remedy.refresh, "records to read")
        if remedy.reconnect:
            self._reconnect(remedy.reconnect, committed_unknown=any(positions[tp] is None for tp in remedy.reconnect))

    def _position(self, tp: TopicPartition) -> int | None:
        """The fetch position without waiting for one (None while it is being reset or fetched)."""
        try:
            state = self._consumer._subscription.subscription.assignment.state_value(tp)
        except AttributeError:  # the assignment changed under us
            return None
        return state.position if state is not None and state.has_valid_position else None

    async def _refresh(self, tps: Iterable[TopicPartition], why: str) -> None:
        log.warning(
            "%s: no progress on %s for %.0f s (%s): refreshing metadata",
            REFRESHED,
            sorted(map(str, tps)),
            self._tracker.stall_s,
            why,
        )
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._consumer._client.force_metadata_update(), ASK_TIMEOUT_S)

    async def _with_records(
        self, suspects: list[TopicPartition], positions: Mapping[TopicPartition, int | None]
    ) -> set[TopicPartition] | None:
        """The suspects with records past their position; None when the end offsets cannot be had
        (a leader that does not answer, or a machine too busy to answer in time)."""
        try:
            ends = await asyncio.wait_for(self._consumer.end_offsets(suspects), ASK_TIMEOUT_S)
        except Exception:
            return None
        return {tp for tp in suspects if positions[tp] is None or ends.get(tp, 0) > positions[tp]}

    def _reconnect(self, stalled: frozenset[TopicPartition], *, committed_unknown: bool) -> None:
        """Close the fetch connections to the stalled partitions' leaders, the one fetched from before
        and the one metadata names now, so the fetch in flight fails and aiokafka starts a new one.
        A partition without a position waits on its committed offset: the group coordinator's
        connection is closed too."""
        client = self._consumer._client
        wanted = set()
        for tp in stalled:
            wanted |= {
                (self._leaders.get(tp), ConnectionGroup.DEFAULT),
                (client.cluster.leader_for_partition(tp), ConnectionGroup.DEFAULT),
            }
        coordinator = getattr(self._consumer._coordinator, "coordinator_id", None)
        if committed_unknown and coordinator is not None:
            wanted.add((coordinator, ConnectionGroup.COORDINATION))
        closed = []
        for key in sorted((k for k in wanted if k[0] is not None and k[0] >= 0), key=str):
            conn = client._conns.get(key)
            if conn is not None and conn.connected():
                conn.close(reason=CloseReason.CONNECTION_BROKEN)
                closed.append(f"{key[0]}/{key[1].name.lower()}")
        self._stats.fetch_stalls_unblocked += 1
        log.warning(
            "%s %s (still stalled after a metadata refresh): closed the connections %s",
            UNBLOCKED,
            sorted(map(str, stalled)),
            closed,
        )
