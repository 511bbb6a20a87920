"""`python -m tests.readme.settle CONFIG (members|answered|stored)`: wait as a person running the
README block would, between its lines, until the system got there (exit 1 on timeout).

members:  every configured model's consumer group has a member;
answered: every request partition's lag is 0 (all requests answered and committed);
stored:   the sink's group has committed every events topic to its end (all events in ClickHouse).
"""

from __future__ import annotations

import asyncio
import sys
import time

from consumers.lag import LagProbe
from pipeline.core.config import Config, load_config
from pipeline.core.kafka.client import Topics

TIMEOUT_S = 120.0


async def _done(config: Config, what: str) -> bool:
    topics = Topics(config.kafka.topic_prefix)
    async with LagProbe(config.kafka) as probe:
        if what == "members":
            groups = [await probe.describe_group(topics.group(m)) for m in config.models]
            return all(g.state == "Stable" and g.members for g in groups)
        if what == "answered":
            for model in config.models:
                partitions = await probe.topic_partitions([topics.requests(model), topics.priority(model)])
                if sum(p.lag for p in await probe.measure(topics.group(model), partitions)) > 0:
                    return False
            return True
        sink_group = f"{config.kafka.topic_prefix}-sink"
        events = await probe.topic_partitions([topics.latency_events, topics.batch_events, topics.lag_events])
        return sum(p.lag for p in await probe.measure(sink_group, events)) == 0


def main(path: str, what: str) -> int:
    config = load_config(path)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if asyncio.run(_done(config, what)):
            return 0
        time.sleep(0.5)
    print(f"settle: {what} not reached in {TIMEOUT_S} s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
