"""The group's shared view: each consumer's beacon out, its peers' beacons in.

Every `fleet_beacon_ms` a consumer publishes a `FleetBeacon` to
`<prefix>.fleet` (one partition, shared by every model): how soon it could
start one more request, its small-batch time, its capacity and the priority
partitions it owns; a generating consumer (iteration-level) also its decode
loop in generation's units (first-token time, decode step by rows, running
requests and room). It also tails that topic and keeps the newest beacon of
each peer in its own group, which `pipeline.core.engine.peer_forwarding.plan_forwards`
(or `decode_forwarding.plan_decode_forwards`) compares with its own queue.
A beacon's age on arrival is one Kafka hop (produce, then fetch), the same
path a forwarded request takes, so its median is the hop the plan charges a
forward. Times are wall-clock ms:
consumers on several hosts need synchronised clocks (NTP), as Kafka's
CreateTime-based waits already do.

Beacons run on their own producer and reader, apart from the consumer's
transactional producer, and losing one costs nothing but a stale view.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
from collections import deque
from collections.abc import Awaitable, Callable

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from consumers.clock import Clock
from pipeline.core.config import KafkaSettings
from pipeline.core.engine.decode_forwarding import DecodePeer, DecodeState
from pipeline.core.engine.peer_forwarding import MemberView
from pipeline.core.kafka.client import Topics, client_options, stop_client
from schemas.messages import FleetBeacon

log = logging.getLogger("batchtide.fleet")
HOP_SAMPLES = 64
HOP_BOUNDS_MS = (1.0, 250.0)
DEFAULT_HOP_MS = 10.0
"""The hop charged before any peer's beacon has arrived."""
SOON_GAP_S = 0.02
"""Beacons asked for at once (`send_soon`) still go at most every 20 ms: a group whose polls leave
the broker empty at every turn (light load, or many members on one partition) must not flood the
fleet topic and its readers on the cores that serve it (eight consumers: at most 400 a second)."""
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(FleetBeacon).decode


class Fleet:
    """Publishes `beacon()` every interval; `peers()` is the newest view of every other member."""

    def __init__(
        self,
        settings: KafkaSettings,
        group: str,
        member_id: str,
        interval_ms: float,
        beacon: Callable[[], FleetBeacon],
        clock: Clock,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._topic = Topics(settings.topic_prefix).fleet
        self._group = group
        self._member_id = member_id
        self._interval_s = interval_ms / 1000.0
        self._beacon = beacon
        self._views: dict[str, MemberView] = {}
        self._decoders: dict[str, DecodePeer] = {}
        self._delays: deque[float] = deque(maxlen=HOP_SAMPLES)
        self._tasks: list[asyncio.Task[None]] = []
        self.sent: dict[str, int] = {}
        """Requests forwarded to each peer since its newest beacon (the plan adds their load)."""
        self.on_heard: Callable[[], None] = lambda: None
        """Called after a peer's newer beacon is taken (share members then look at their pull rule again)."""
        self._soon = asyncio.Event()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._keep(self._publish), name="fleet-beacon"),
            loop.create_task(self._keep(self._listen), name="fleet-listen"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def send_soon(self) -> None:
        """Publish the next beacon now, not at the interval: the consumer's state just changed in a way
        its peers act on (a share member left the broker empty)."""
        self._soon.set()

    def peers(self) -> list[MemberView]:
        return list(self._views.values())

    def decode_peers(self) -> dict[str, DecodePeer]:
        """The peers whose beacons describe a decode loop, by member id."""
        return dict(self._decoders)

    @property
    def hop_ms(self) -> float:
        if not self._delays:
            return DEFAULT_HOP_MS
        low, high = HOP_BOUNDS_MS
        return min(high, max(low, statistics.median(self._delays)))

    def heard(self, beacon: FleetBeacon, now_ms: float) -> None:
        """Take a peer's beacon (own beacons and other groups' are ignored)."""
        if beacon.group != self._group or beacon.member_id == self._member_id:
            return
        known = self._views.get(beacon.member_id)
        if known is not None and known.at_ms >= beacon.at_ms:
            return
        self._delays.append(max(0.0, now_ms - beacon.at_ms))
        self._views[beacon.member_id] = MemberView(
            member_id=beacon.member_id,
            at_ms=float(beacon.at_ms),
            start_in_ms=beacon.start_in_ms,
            batch_ms=beacon.batch_ms,
            capacity_per_s=beacon.capacity_per_s,
            partitions=tuple(beacon.partitions),
            load=beacon.load,
            batches=beacon.batches,
            unit_ms=beacon.unit_ms,
            drained_at_ms=beacon.drained_at_ms,
        )
        if beacon.first_token_ms is not None:
            self._decoders[beacon.member_id] = DecodePeer(
                beacon.member_id,
                float(beacon.at_ms),
                tuple(beacon.partitions),
                DecodeState(
                    start_in_ms=beacon.start_in_ms,
                    first_token_ms=beacon.first_token_ms,
                    steps=tuple((int(rows), float(ms)) for rows, ms in beacon.decode_steps or ()),
                    running=beacon.running or 0,
                    room=beacon.room or 0,
                    slot_every_ms=beacon.slot_every_ms or 0.0,
                ),
            )
        self.sent.pop(beacon.member_id, None)
        self.on_heard()

    async def _keep(self, run: Callable[[], Awaitable[object]]) -> None:
        """Beacons must never end while the consumer serves: a failed session is rebuilt."""
        while True:
            try:
                await run()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("fleet %s restarting after %r", self._member_id, e)
                await asyncio.sleep(max(self._interval_s, 1.0))

    async def _publish(self) -> None:
        producer = AIOKafkaProducer(**client_options(self._settings), linger_ms=0)
        await producer.start()
        try:
            key = self._member_id.encode()
            while True:
                await producer.send(self._topic, _encode(self._beacon()), key=key)
                await asyncio.sleep(SOON_GAP_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._soon.wait(), max(0.0, self._interval_s - SOON_GAP_S))
                self._soon.clear()
        finally:
            await stop_client(producer.stop, f"fleet {self._member_id}: its producer", 2.0)

    async def _listen(self) -> None:
        reader = AIOKafkaConsumer(**client_options(self._settings), group_id=None, enable_auto_commit=False)
        await reader.start()
        try:
            partition = TopicPartition(self._topic, 0)
            reader.assign([partition])
            await reader.seek_to_end(partition)
            while True:
                got = await reader.getmany(timeout_ms=500)
                now = self._clock.now_ms()
                for records in got.values():
                    for record in records:
                        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                            self.heard(_decode(record.value or b""), now)
        finally:
            await stop_client(reader.stop, f"fleet {self._member_id}: its reader", 2.0)
