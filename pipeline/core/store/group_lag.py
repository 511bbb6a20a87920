"""Every model's consumer-group lag, sampled from the broker by the sink.

A consumer records its own lag (consumers/lag.py), so a model whose last
consumer is gone records none, and nothing could alert on exactly the
failure an on-call engineer most needs to hear about. The sink runs
always, so it also samples each model's group from outside, as Burrow and
kafka-lag-exporter do: committed against end offsets on the model's request
topics, the CreateTime of the record at the committed offset (the oldest
unanswered one), and the group's member count. Groups are the configured
models plus every `<prefix>.consumers.*` group the broker knows, so a model
missing from the sink's config is still watched.

The dead-letter topic, shared by all models, is sampled too (its end
offsets, lag 0, model ''), so the dead-letter rate comes from the topic
itself rather than from counters of consumers that may be gone.

One sample costs a handful of admin requests per model plus one one-record
fetch per lagging partition; a sample that takes longer than the interval
is abandoned, and a failed one costs that sample only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import Topics
from pipeline.core.kafka.lag_probe import LagProbe
from schemas.messages import PartitionLag

log = logging.getLogger("batchtide.sink")

MIN_SAMPLE_TIMEOUT_S = 10.0
"""A sample may take at least this long (the coordinator of a new group answers slowly)."""


@dataclass(frozen=True)
class GroupSample:
    """One model's group as the broker sees it at `ts_ms` (or the dead-letter topic, model '')."""

    ts_ms: int
    model: str
    members: int
    """Members of the group (0: nobody serves the model)."""
    partitions: list[PartitionLag]


async def sample_groups(
    probe: LagProbe, topics: Topics, models: Iterable[str], *, share: bool = False
) -> list[GroupSample]:
    """A sample of each model's group (configured or found on the broker), then the DLQ's. With
    `share`, each model's share group: its members are counted by consumer (a consumer runs several)."""
    from pipeline.core.kafka.share_client import consumer_of

    found: set[str] = set()
    if not share:
        prefix = topics.group("")
        found = {group[len(prefix) :] for group in await probe.group_ids(prefix)}
    samples = []
    for model in sorted(set(models) | found):
        group = topics.share_group(model) if share else topics.group(model)
        view = await probe.describe(group, share=share)
        partitions = await probe.topic_partitions([topics.requests(model), topics.priority(model)])
        rows = await probe.lag(group, partitions, share=share)
        members = len({consumer_of(m.client_id) for m in view.members}) if share else len(view.members)
        samples.append(GroupSample(int(time.time() * 1000), model, members, rows))
    dlq = await probe.topic_partitions([topics.dlq])
    if dlq:
        ends = await probe.end_offsets(dlq)
        letters = [PartitionLag(tp.topic, tp.partition, ends.get(tp, 0), -1, 0, 0, 0.0) for tp in dlq]
        samples.append(GroupSample(int(time.time() * 1000), "", 0, letters))
    return samples


class GroupLagSampler:
    """Samples every `interval_s` and hands each sample to `deliver`, until cancelled."""

    def __init__(
        self,
        settings: KafkaSettings,
        models: Iterable[str],
        interval_s: float,
        deliver: Callable[[GroupSample], Awaitable[None]],
        *,
        share: bool = False,
    ) -> None:
        self.settings = settings
        self.topics = Topics(settings.topic_prefix)
        self.models = tuple(models)
        self.interval_s = interval_s
        self.deliver = deliver
        self.share = share
        self.samples = 0
        self.failures = 0

    async def run(self) -> None:
        """Sample forever; a probe that fails (the broker is down) is rebuilt after an interval."""
        while True:
            try:
                async with LagProbe(self.settings) as probe:
                    await self._sample_every_interval(probe)
            except Exception as e:
                self.failures += 1
                log.warning("group lag sampler restarting after %s", str(e) or type(e).__name__)
                await asyncio.sleep(self.interval_s)

    async def _sample_every_interval(self, probe: LagProbe) -> None:
        next_sample = time.monotonic()
        while True:
            timeout = max(self.interval_s, MIN_SAMPLE_TIMEOUT_S)
            try:
                samples = await asyncio.wait_for(
                    sample_groups(probe, self.topics, self.models, share=self.share), timeout
                )
            except TimeoutError:
                self.failures += 1
                log.warning("group lag sample skipped: it took more than %.0f s", timeout)
            else:
                for sample in samples:
                    await self.deliver(sample)
                self.samples += 1
            next_sample = max(next_sample + self.interval_s, time.monotonic())
            await asyncio.sleep(next_sample - time.monotonic())
