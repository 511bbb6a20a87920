"""Reading the request partitions: priority first, paused while the queue is full.

Backpressure is Kafka's own: past `max_queue - max_queue/8` requests held in
the engine the request partitions are paused (the backlog waits in Kafka,
where it is cheap), the priority partitions only at `max_queue`, so urgent
requests and tail forwards keep flowing; everything resumes below
`RESUME_FRACTION` of `max_queue`. The loop asks for at most the room left
(`getmany(max_records=room)`), which makes the bound exact.
"""

from __future__ import annotations

from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from consumers.stats import ConsumerStats

RESUME_FRACTION = 0.75
"""Paused partitions resume once the queue is back under this share of max_queue."""


class Fetcher:
    """Which partitions to read and reading them, for one consumer."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        priority_topic: str,
        max_queue: int,
        stats: ConsumerStats,
        holding: set[TopicPartition],
    ) -> None:
        self._consumer = consumer
        self._holding = holding
        """Partitions not started yet (consumers/stable_start.py): paused whatever the queue."""
        self._priority_topic = priority_topic
        self._max_queue = max_queue
        self._stats = stats
        self.paused = False
        """Request partitions are paused (backpressure)."""

    async def fetch(self, want: int) -> dict[TopicPartition, list[ConsumerRecord]]:
        """Priority partitions first: whatever is buffered there is taken before the rest."""
        consumer = self._consumer
        priority = [tp for tp in consumer.assignment() if tp.topic == self._priority_topic]
        got: dict[TopicPartition, list[ConsumerRecord]]
        if priority:
            got = await consumer.getmany(*priority, timeout_ms=0, max_records=want)
            if got:
                return got
        # paused: come back soon to resume as the queue drains (a paused fetch returns nothing)
        got = await consumer.getmany(timeout_ms=10 if self.paused else 100, max_records=want)
        return got

    def flow(self, queued: int) -> None:
        """Pause or resume partitions for `queued` requests held in the engine."""
        limit = self._max_queue
        if queued >= limit - max(1, limit // 8):
            if not self.paused:
                self._stats.pauses += 1
            self.paused = True
        elif self.paused and queued <= limit * RESUME_FRACTION:
            self.paused = False
        priority_full = queued >= limit
        consumer = self._consumer
        paused, holding = consumer.paused(), self._holding
        for tp in consumer.assignment():
            want_paused = tp in holding or (priority_full if tp.topic == self._priority_topic else self.paused)
            if want_paused and tp not in paused:
                consumer.pause(tp)
            elif not want_paused and tp in paused:
                consumer.resume(tp)

    def backlog(self, position: Callable[[TopicPartition], int | None]) -> int:
        """Kafka lag of the assigned partitions: high watermark minus fetch position, no extra request."""
        consumer = self._consumer
        backlog = 0
        for tp in consumer.assignment():
            high = consumer.highwater(tp)
            if high is None:
                continue
            fetched = position(tp)
            if fetched is not None:
                backlog += max(high - fetched, 0)
        return backlog
