"""Share-group mode (`[consumer] group_type = "share"`): how records arrive and how they are acknowledged.

In a share group the broker hands any member any record of any partition,
each under a time-limited lock, and takes it back unless the member
acknowledges it: ACCEPT (done), RELEASE (deliver it again, to anyone) or
REJECT (never deliver it again). The engine, the runners, the answers and
the events are the same as in a partition group; this module replaces the
fetcher, the offset commits and the group membership:

- members: a consumer runs `max_inflight_batches + 1` members of its
  model's share group on the request topic, and one on the priority topic
  (a second subscription, drained first: it polls whatever the device is
  doing). The preview client refuses a member's next poll before every
  record of its last one is acknowledged, so one member cannot fetch ahead
  of its own answers; several members let one poll's requests run while
  the next poll's wait.
- the pull rule: a request member polls only while the device has a free
  slot, so a slow device holds only what it is about to run and the rest
  stays on the broker for faster peers (nothing is forwarded). One poll is
  bounded by the engine's largest batch, and a member clearly slower than a
  peer takes only the batch it finishes no later than that peer would
  (`pipeline.core.engine.share_pull`, fed by the consumer from its learned
  t(b) and its peers' beacons; a new beacon makes the members look again).
- verdicts: ACCEPT once the record's answer is on the broker (the
  producer's delivery confirmed), REJECT once the dead letter of a record
  refused at admission is; a request the engine expires is answered
  `expired` and ACCEPTed (another member could not run it in time either).
  RELEASE at a stop (and after an error) for every record not answered.
  A member's records are acknowledged and committed together, once the
  last of its poll has a verdict.
- at-least-once: acknowledgements cannot join a Kafka transaction, so a
  consumer that dies between publishing an answer and acknowledging its
  record has the record delivered again when the lock expires, and it is
  answered twice on the results topic. Readers drop the second answer by
  request id (`pipeline.core.kafka.first_answers`).
- the lock: the client cannot renew it, so a record held longer than the
  group's `share.record.lock.duration.ms` goes to another member while it
  still runs here. `check_lock` compares the longest batch the model's
  profile predicts with the lock at start and refuses to start when it
  does not fit.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiokafka import ConsumerRecord, TopicPartition

from consumers.delivery import Delivery
from consumers.stats import ConsumerStats
from pipeline.core.config import ConfigError, KafkaSettings, ModelConfig
from pipeline.core.kafka.client import stop_client
from pipeline.core.kafka.offsets import OffsetTracker
from pipeline.core.kafka.outbox import Message
from pipeline.core.kafka.share_client import ShareGroupConfig, ShareMember, ShareRecord, Verdict, member_client_id

log = logging.getLogger("batchtide.consumer")

Place = tuple[TopicPartition, int]
Key = tuple[str, int, int]
"""(topic, partition, offset) of a delivered record."""

POLL_S = 0.1
"""Longest one member's poll waits for records (it then looks at the stop flag and the pull rule again)."""
LOCK_SHARE = 0.5
"""The longest batch the profile predicts must take at most this share of the record lock: the rest
is the wait for a free slot, publishing, acknowledging and the profile's error."""


def _key(tp: TopicPartition, offset: int) -> Key:
    return (tp.topic, tp.partition, offset)


@dataclass(frozen=True)
class LockCheck:
    """The longest batch the model's profile predicts, against the share group's record lock."""

    longest_batch_ms: float | None
    """None: nothing predicts it (no profile file, no cost model)."""
    how: str
    lock_ms: int

    @property
    def fits(self) -> bool:
        return self.longest_batch_ms is None or self.longest_batch_ms <= LOCK_SHARE * self.lock_ms


def predicted_batch_ms(points: Sequence[tuple[int, float]], size: int) -> float:
    """t(size) from measured (size, ms) points: interpolated between them, extended past the largest
    along the line through the last two (a batch larger than any measured costs at least that)."""
    ordered = sorted(points)
    if len(ordered) == 1 or size <= ordered[0][0]:
        first = ordered[0]
        return first[1] if size <= first[0] else first[1] * size / first[0]
    for (b0, t0), (b1, t1) in itertools.pairwise(ordered):
        if size <= b1:
            return t0 + (t1 - t0) * (size - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = ordered[-2], ordered[-1]
    return t1 + max(0.0, (t1 - t0) / (b1 - b0)) * (size - b1)


def check_lock(model: ModelConfig, ceiling: int, prior_costs: Sequence[tuple[int, float]], lock_ms: int) -> LockCheck:
    """What the model's profile predicts for its largest batch (`ceiling`), against `lock_ms`.

    A generation runs to its end inside one batch (static batching) or one row of the decode
    loop (iteration batching): either way the batch time at the ceiling bounds how long its
    records are held, and a deadline (`default_deadline_ms`) cuts it where one is set."""
    if prior_costs:
        longest, how = predicted_batch_ms(prior_costs, ceiling), f"the profile file's curve at {ceiling}"
    elif model.runner == "cost-model":
        points = model.cost_points or (
            (1, model.cost_a_ms + model.cost_c_ms),
            (2, model.cost_a_ms + 2 * model.cost_c_ms),
        )
        longest, how = predicted_batch_ms(points, ceiling), f"the cost model at {ceiling}"
    elif model.runner == "zero-cost":
        longest, how = 0.0, "the zero-cost runner"
    else:
        return LockCheck(None, "no profile file (run `batchtide profile`)", lock_ms)
    deadline = model.profile.default_deadline_ms
    if deadline is not None and deadline < longest:
        longest, how = float(deadline), f"{how}, cut by default_deadline_ms"
    return LockCheck(longest, how, lock_ms)


def enforce_lock(model: ModelConfig, check: LockCheck) -> None:
    """Refuse to start a consumer whose batches could outlive their records' lock; say what an
    unpredicted one risks."""
    if check.longest_batch_ms is None:
        log.warning(
            "model %s: share mode cannot check its batches against the record lock (%d ms): %s. A batch "
            "running longer than the lock has its records delivered to another member while it runs "
            "(answered twice; readers keep the first)",
            model.name,
            check.lock_ms,
            check.how,
        )
        return
    if not check.fits:
        raise ConfigError(
            f"model {model.name}: its longest batch is predicted at {check.longest_batch_ms:.0f} ms ({check.how}), "
            f"more than {LOCK_SHARE:.0%} of its share group's record lock ({check.lock_ms} ms). The preview "
            "client cannot renew a lock, so its records would be delivered again while they run. Raise the "
            "group's share.record.lock.duration.ms (the broker allows up to "
            "group.share.max.record.lock.duration.ms, 60 s by default), or lower hard_cap, max_new_tokens "
            "or default_deadline_ms"
        )


def layout_warning(model: ModelConfig, partitions: int) -> str | None:
    """What to say about a share-mode model's request partitions (None: nothing to say).

    The broker's share assignor gives each member partitions of its own while members are no more
    than partitions, and a slow consumer balances only on partitions it shares: one partition
    shares everything, and more partitions than consumers share nothing."""
    if partitions <= 1:
        return None
    members = model.profile.max_inflight_batches + 1
    return (
        f"share mode: model {model.name}'s request topic has {partitions} partitions. A share group balances a "
        f"slow consumer only on the partitions it shares with its peers, and members (each consumer runs {members} "
        f"on the request topic) get partitions of their own while they are no more than the partitions. Run more "
        f"consumers than partitions, and use one partition unless one cannot carry the model's rate (measure it "
        f"with `batchtide bench share-partition --poll-records N` at the batch sizes the model runs; see "
        f"docs/share-groups.md)"
    )


class EveryRecord(OffsetTracker[TopicPartition]):
    """Admission's offset tracker in share mode: no commit point, so no record is skipped by offset
    (a record delivered again is judged by its request id)."""

    def received(self, partition: TopicPartition, offset: int) -> bool:
        return True


@dataclass
class _Poll:
    """What one member holds: the records of its last poll and their verdicts so far."""

    member: ShareMember
    priority: bool
    verdicts: dict[Key, Verdict]
    settled: asyncio.Event


class ShareIntake:
    """The members of one consumer, the pull rule, and the verdicts of what they delivered."""

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        group_id: str,
        consumer_id: str,
        request_topic: str,
        priority_topic: str,
        members: int,
        max_records: int,
        max_queue: int,
        stats: ConsumerStats,
        may_pull: Callable[[], int],
    ) -> None:
        """`may_pull()`: how many records a request member's poll may take now (0: none)."""
        self._max_queue = max_queue
        self._members = [
            ShareMember(settings, group_id, member_client_id(consumer_id, str(i)), [request_topic], max_records)
            for i in range(members)
        ]
        self._priority = ShareMember(
            settings, group_id, member_client_id(consumer_id, "priority"), [priority_topic], max_records
        )
        self._stats = stats
        self._may_pull = may_pull
        self._delivered: asyncio.Queue[list[ShareRecord]] = asyncio.Queue()
        self._owner: dict[Key, _Poll] = {}
        self._nudge = asyncio.Event()
        self._pulling = asyncio.Lock()
        """One request member polls at a time: a poll takes what is there, a second at once would only
        hold more than the device is about to run."""
        self._tasks: list[asyncio.Task[None]] = []
        self._handed = 0
        """Records polled and not yet taken by the loop (`fetch`)."""
        self._stopping = False
        self.paused = False
        self.on_drained: Callable[[], None] = lambda: None
        """Called when a request member's poll brought fewer records than it asked for (the broker had
        no more): the consumer's beacon says when."""

    async def open(self) -> None:
        await asyncio.gather(*(m.open() for m in (*self._members, self._priority)))
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._serve(m, priority=False), name=f"share-{m.client_id}") for m in self._members
        ]
        self._tasks.append(loop.create_task(self._serve(self._priority, priority=True), name="share-priority"))

    def _pull_now(self) -> int:
        """How many records a request member may poll: none while paused or while records handed
        out are still on their way to the engine; else what the pull rule allows."""
        return 0 if self.paused or self._handed else max(0, self._may_pull())

    def nudge(self) -> None:
        """The device or the queue changed: members waiting on the pull rule look again."""
        self._nudge.set()

    async def _wait_nudge(self) -> None:
        self._nudge.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._nudge.wait(), POLL_S)

    async def _serve(self, member: ShareMember, *, priority: bool) -> None:
        """Poll, hand the records to the loop, wait for every verdict, acknowledge; again until stopped."""
        while not self._stopping:
            if priority:
                if self.paused:
                    await self._wait_nudge()
                    continue
                records = await member.poll(POLL_S)
            else:
                if not self._pull_now():
                    await self._wait_nudge()
                    continue
                async with self._pulling:
                    limit = self._pull_now()
                    if not limit:
                        continue
                    records = await member.poll(POLL_S, limit)
                    if len(records) < limit:
                        self.on_drained()
                    self._stats.share_released_excess = sum(m.released_excess for m in self._members)
            if not records:
                continue
            poll = _Poll(member, priority, {}, asyncio.Event())
            self._handed += len(records)
            for r in records:
                key = (r.record.topic, r.record.partition, r.record.offset)
                earlier = self._owner.get(key)
                if earlier is not None:  # its lock expired while it waited here: that delivery is void
                    self._verdict(earlier, key, "release")
                self._owner[key] = poll
                if r.delivery_count > 1:
                    self._stats.share_redelivered += 1
            self._delivered.put_nowait(records)
            await poll.settled.wait()
            await self._acknowledge(poll)

    async def _acknowledge(self, poll: _Poll) -> None:
        stats, held = self._stats, poll.member.held
        for key in held:
            if self._owner.get(key) is poll:
                del self._owner[key]
        verdicts = [poll.verdicts.get(key, "release") for key in held]
        stats.share_accepted += verdicts.count("accept")
        stats.share_rejected += verdicts.count("reject")
        stats.share_released += verdicts.count("release")
        refused = await poll.member.settle(poll.verdicts)
        stats.share_late_acks += refused
        if refused:
            log.warning(
                "share member %s: the broker refused %d acknowledgements (their lock had expired): "
                "those records are delivered again",
                poll.member.client_id,
                refused,
            )
        stats.commits += 1
        self.nudge()

    async def fetch(self, _want: int) -> dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]:
        """Records the members delivered since the last call, by partition (waits up to POLL_S)."""
        batches: list[list[ShareRecord]] = []
        with contextlib.suppress(TimeoutError):
            batches.append(await asyncio.wait_for(self._delivered.get(), POLL_S))
        while not self._delivered.empty():
            batches.append(self._delivered.get_nowait())
        out: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] = {}
        for batch in batches:
            self._handed -= len(batch)
            for r in batch:
                out.setdefault(TopicPartition(r.record.topic, r.record.partition), []).append(r.record)
        return out

    def flow(self, queued: int) -> None:
        """Backpressure: no member polls while the engine holds `max_queue` requests or more."""
        paused = queued >= self._max_queue
        if paused and not self.paused:
            self._stats.pauses += 1
        self.paused = paused

    def backlog(self, _position: Callable[[TopicPartition], int | None]) -> int:
        """Unknown to a member: the group's records wait on the broker for whichever member pulls
        first (the group's lag is sampled from the broker: `pipeline.core.kafka.share_admin`)."""
        return 0

    def settle(self, places: Sequence[Place], verdict: Verdict) -> None:
        """`places` have their verdict; a poll whose records all have one is acknowledged."""
        for tp, offset in places:
            key = _key(tp, offset)
            poll = self._owner.get(key)
            if poll is not None:
                self._verdict(poll, key, verdict)

    @staticmethod
    def _verdict(poll: _Poll, key: Key, verdict: Verdict) -> None:
        poll.verdicts.setdefault(key, verdict)
        if len(poll.verdicts) >= len(poll.member.held):
            poll.settled.set()

    async def close(self, timeout_s: float) -> None:
        """Stop polling; release every record not answered; leave the group."""
        self._stopping = True
        for poll in {id(p): p for p in self._owner.values()}.values():
            poll.settled.set()  # what has no verdict is released by `ShareMember.settle`

        async def stop() -> None:
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await asyncio.gather(*(m.close() for m in (*self._members, self._priority)), return_exceptions=True)

        await stop_client(stop, "the share group members", timeout_s)
        for task in self._tasks:
            task.cancel()


class SharePublisher:
    """Publishes answers; then their records are acknowledged (ACCEPT, or REJECT for refusals)."""

    def __init__(self, delivery: Delivery, intake: ShareIntake, stats: ConsumerStats) -> None:
        self.tracker: OffsetTracker[TopicPartition] = EveryRecord()
        self._delivery = delivery
        self._intake = intake
        self._stats = stats

    async def publish(self, messages: Sequence[Message], done: Sequence[Place], refused: Sequence[Place] = ()) -> bool:
        try:
            await self._delivery.deliver(messages)
        finally:
            self._stats.rebuilt, self._stats.delivery_retries = self._delivery.rebuilt, self._delivery.retries
        rejected = set(refused)
        self._intake.settle([p for p in done if p not in rejected], "accept")
        self._intake.settle(list(rejected), "reject")
        return True

    async def commit(self, partitions: set[TopicPartition] | None = None) -> None:
        """Nothing to commit: each poll is acknowledged as its last record gets a verdict."""

    def joined(self) -> None:
        """Share groups have no generations to fence by."""


def describe_lock(config: ShareGroupConfig) -> str:
    return f"record lock {config.lock_ms} ms, delivery limit {config.delivery_limit}"
