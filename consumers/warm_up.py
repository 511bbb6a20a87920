"""Warming the device before the consumer joins its group.

A real model's first batch at a new size is several times slower (allocator
growth, page faults, kernel choice), so the consumer runs throwaway batches
of doubling size before it takes partitions: neither the first live burst
nor the engine's t(b) pays for it. A member that joined before its model
was ready would hold partitions it cannot serve.
"""

from __future__ import annotations

from consumers.clock import Clock
from consumers.runners.base import Runner, run_isolating
from schemas.messages import Request

WARM_UP_TEXT = "warm up the device before the group hands this consumer its partitions"
WARM_UP_MAX_BATCH = 64
WARM_UP_BUDGET_S = 2.0
"""Warm-up doubles the batch size up to the engine's ceiling (at most 64 requests) while
the next batch is expected to fit in this budget."""


def warm_up(runner: Runner, model: str, ceiling: int, clock: Clock) -> list[int]:
    """Load the runner and run the warm-up batches; returns their sizes (none past a size the
    runner refuses, one for a simulated device)."""
    runner.load()
    top = 1 if runner.simulated else min(ceiling, WARM_UP_MAX_BATCH)
    sizes: list[int] = []
    size, spent_s, last_s = 1, 0.0, 0.0
    while size <= top and spent_s + 2 * last_s <= WARM_UP_BUDGET_S:
        probes = [Request(id=f"batchtide-warm-up-{size}-{i}", model=model, text=WARM_UP_TEXT) for i in range(size)]
        if runner.check(probes[0]) is not None:
            break
        start = clock.monotonic_s()
        run_isolating(runner, probes)
        last_s = clock.monotonic_s() - start
        spent_s += last_s
        sizes.append(size)
        size *= 2
    return sizes
