"""One consumer process: its topics, its consumer, its lag recorder and status line, until stopped.

`batchtide consume` runs this. The consumer is built from the config
(`consumers.worker.build_consumer`), started (warm-up, then joining the
group), and run until `stop` is set; its runner is closed whatever happens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from consumers.heap import freeze_heap
from consumers.lag import lag_recorder
from consumers.sharing import layout_warning
from consumers.worker import Consumer, build_consumer
from pipeline.core.config import Config
from pipeline.core.kafka.client import ensure_topics

log = logging.getLogger("batchtide.consumer")


async def serve(
    config: Config,
    model_name: str,
    stop: asyncio.Event,
    *,
    consumer_id: str | None = None,
    create_topics: bool = True,
    on_stats: Callable[[Consumer], None] | None = None,
    stats_interval_s: float = 10.0,
) -> Consumer:
    """Run one consumer until `stop` is set; returns it (its stats) after a clean shutdown."""
    consumer = build_consumer(config, model_name, consumer_id=consumer_id)
    lag = lag_recorder(consumer, config.kafka, config.consumer.lag_interval_ms)
    reporter = None
    try:
        if create_topics:
            counts = await ensure_topics(config.kafka, {model_name: consumer.model.partitions})
            warning = layout_warning(consumer.model, counts.get(consumer.request_topic, 0)) if consumer.share else None
            if warning:
                log.warning("%s", warning)
        await consumer.start()
        freeze_heap()  # this process is the consumer's: what it loaded stays for its lifetime
        if lag is not None:
            lag.start()
        if on_stats is not None:
            report = on_stats

            async def every_interval() -> None:
                while True:
                    await asyncio.sleep(stats_interval_s)
                    report(consumer)

            reporter = asyncio.create_task(every_interval())
        await consumer.run(stop)
    finally:
        if reporter is not None:
            reporter.cancel()
        if lag is not None:
            await lag.stop()
        await asyncio.to_thread(consumer.runner.close)
    return consumer
