"""Every model's load sent at once, open loop, and how long each request took to come back.

The demo's ramp: each model gets its own send schedule (its scenario's busiest
phase at rising rates) on the client's clock, with the others running beside
it, and each request's latency is read from the model's results topic as the
client sees it. The requests are tagged as warm-up traffic, so reports leave
them out of every figure.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import numpy as np

from pipeline.core.config import KafkaSettings
from pipeline.tools.devtools.producer import Load, LoadProducer
from pipeline.tools.harness.results import ResultArrivals

TAG = "ramp-"


async def _one(
    settings: KafkaSettings, model: str, load: Load, seed: int, drain_s: float, stop: Callable[[], bool], run_id: str
) -> np.ndarray:
    arrivals = ResultArrivals(settings, model)
    await arrivals.start()
    try:
        async with LoadProducer(settings, model, run_id=run_id, seed=seed) as producer:
            await producer.send(load, tag=TAG, warmup=True)
            ids = [producer.request_id(index, TAG) for index in range(len(load))]
            await arrivals.wait_until(
                lambda: stop() or all(rid in arrivals.received_ms for rid in ids), timeout_s=drain_s, poll_s=0.1
            )
            return np.array([
                arrivals.received_ms[rid] - producer.sent_ms[rid]
                if rid in arrivals.received_ms and arrivals.outcomes[rid] == "ok"
                else math.inf
                for rid in ids
            ])  # fmt: skip
    finally:
        await arrivals.stop()


async def send_together(
    settings: KafkaSettings,
    loads: dict[str, Load],
    seeds: dict[str, int],
    *,
    drain_s: float = 90.0,
    stop: Callable[[], bool] = lambda: False,
    run_id: str = "ramp",
) -> dict[str, np.ndarray]:
    """Send every model's load at once on its schedule, then wait (at most `drain_s`) for the answers;
    per model, each request's latency in ms in the load's order (inf: unanswered or not `ok`)."""
    results = await asyncio.gather(
        *(_one(settings, model, load, seeds.get(model, 0), drain_s, stop, run_id) for model, load in loads.items())
    )
    return dict(zip(loads, results, strict=True))
