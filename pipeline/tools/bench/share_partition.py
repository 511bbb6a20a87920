"""`bench share-partition`: what one request partition carries for a share group, on this broker.

Share mode balances a slow consumer only on partitions it shares with its
peers, so its layout wants few request partitions; this measures how many
records one partition hands out and takes acknowledgements for per second,
so the layout can be sized from a figure taken where it runs. Each trial
fills one partition with `records` requests (produced as an open-loop
producer sends them: linger 0), then `members` share members (the product's
`ShareMember`, each in its own thread) poll up to `poll_records` at a time
and ACCEPT everything until the partition is drained. Nothing runs a model,
so the figure is the broker's and the client's: a consumer's own work
(decoding, batching, publishing answers) comes on top.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka import AIOKafkaProducer

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import client_options, create_topics
from pipeline.core.kafka.share_client import ShareMember, prepare_share_group

PAD = "x" * 120
"""A request's text, about the size of the benches' requests."""


@dataclass(frozen=True)
class PartitionTrial:
    members: int
    poll_records: int
    records: int
    seconds: float
    polls: int
    released: int = 0
    """Records handed out past a poll's bound and released at once (the client's bound is soft)."""

    @property
    def per_s(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_poll(self) -> float:
        return self.records / self.polls if self.polls else 0.0


async def _fill(kafka: KafkaSettings, topic: str, records: int) -> None:
    producer = AIOKafkaProducer(**client_options(kafka), linger_ms=0, acks="all")
    await producer.start()
    try:
        sends = []
        for i in range(records):
            value = json.dumps({"id": f"r{i}", "model": "m", "text": PAD}).encode()
            sends.append(await producer.send(topic, value, partition=0))
        await asyncio.gather(*sends)
    finally:
        await producer.stop()


async def _drain(members: list[ShareMember], records: int, timeout_s: float) -> tuple[float, int]:
    """Seconds from the first record to the last acknowledged, and the polls it took."""
    done = polls = 0
    first: float | None = None
    deadline = time.monotonic() + timeout_s

    async def serve(member: ShareMember) -> None:
        nonlocal done, polls, first
        while done < records and time.monotonic() < deadline:
            got = await member.poll(0.1)
            if not got:
                continue
            if first is None:
                first = time.monotonic()
            polls += 1
            await member.settle({(r.record.topic, r.record.partition, r.record.offset): "accept" for r in got})
            done += len(got)

    await asyncio.gather(*(serve(m) for m in members))
    return (time.monotonic() - first if first is not None else 0.0), polls


async def run_trial(
    kafka: KafkaSettings, members: int, poll_records: int, records: int, tag: str, timeout_s: float = 120.0
) -> PartitionTrial:
    topic = f"{kafka.topic_prefix}.share-partition.{tag}"
    group = f"{kafka.topic_prefix}.share-partition.{tag}"
    await create_topics(kafka, {topic: 1})
    await prepare_share_group(kafka, group)
    await _fill(kafka, topic, records)
    joined = [ShareMember(kafka, group, f"{tag}-{i}", [topic], poll_records) for i in range(members)]
    await asyncio.gather(*(m.open() for m in joined))
    try:
        seconds, polls = await _drain(joined, records, timeout_s)
    finally:
        await asyncio.gather(*(m.close() for m in joined))
    return PartitionTrial(members, poll_records, records, seconds, polls, sum(m.released_excess for m in joined))


async def run_partition_bench(
    kafka: KafkaSettings,
    members: tuple[int, ...],
    poll_records: tuple[int, ...],
    records: int,
    say: Callable[[str], None],
) -> list[PartitionTrial]:
    trials = []
    for n in members:
        for size in poll_records:
            trial = await run_trial(kafka, n, size, records, f"m{n}-p{size}-{time.monotonic_ns()}")
            say(
                f"members {n}  poll {size}: {trial.per_s:,.0f} records/s over {trial.seconds:.1f} s "
                f"({trial.polls} polls, {trial.mean_poll:.1f} records each; {trial.released} released past the bound)"
            )
            trials.append(trial)
    return trials
