"""A bounded stop for the sink's Kafka consumer, which faust runs in a thread of its own.

mode waits a fixed 60 s (`ServiceThread.shutdown_timeout`) for that thread to
say it has shut down, and the thread says so only after aiokafka's
`consumer.stop()` returns. With the broker gone that stop waits on a
coordinator that never answers, or raises the cancellation of its own fetch
tasks, and the wait ends in a TimeoutError traceback a minute later. faust
has no setting for either, so the sink replaces the thread's stop hook with
one that gives aiokafka at most the budget, logs what it left behind, and
always lets the thread finish. Offsets of events already stored were
committed on the way (every second); anything else is redelivered to the
next sink, which is what an unclean stop costs anyway.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("batchtide.sink")

THREAD_SHARE = 0.8
"""Share of the stop budget aiokafka's own stop gets; the rest is the thread's and the app's teardown."""


def bounded(stop: Callable[[], Awaitable[None]], budget_s: float) -> Callable[[], Awaitable[None]]:
    """`stop`, ended after `budget_s` and never raising: the caller's shutdown must go on."""

    async def bounded_stop() -> None:
        try:
            await asyncio.wait_for(stop(), budget_s)
        except TimeoutError:
            log.warning(
                "sink: the Kafka consumer did not stop within %.1f s (broker unreachable?); leaving it", budget_s
            )
        except (asyncio.CancelledError, Exception) as e:
            log.warning("sink: the Kafka consumer stopped with %s (broker unreachable?)", type(e).__name__)

    return bounded_stop


def bound_consumer_thread(app: Any, budget_s: float) -> None:
    """Bound the stop of `app`'s consumer thread (faust's aiokafka driver) by `budget_s` in all."""
    thread = app.consumer._thread
    thread.on_thread_stop = bounded(thread.on_thread_stop, budget_s * THREAD_SHARE)
    # mode's own wait for the thread, as a backstop should the hook above ever be bypassed
    thread.shutdown_timeout = budget_s
