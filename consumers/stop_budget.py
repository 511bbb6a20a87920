"""How a stopping consumer spends `ConsumerSettings.stop_timeout_s`.

A stop (SIGTERM, a rolling restart) must end within the budget whatever the
broker does: aiokafka can wait forever for a broker that is gone. The first
`STOP_WORK_SHARE` of it finishes held work (the engine keeps dispatching by
its usual rules, running batches and publishes finish); the rest commits
what that answered and closes the Kafka clients, each step taking an equal
share of what is left, at least `MIN_STEP_S`. What is unfinished stays
uncommitted: the group reads it again. Pure: times are passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.core.kafka.client import CLIENT_STOP_S

STOP_WORK_SHARE = 0.8
"""Share of `stop_timeout_s` for finishing held work; committing and closing get the rest."""
MIN_STEP_S = 1.0


@dataclass(frozen=True)
class StopBudget:
    work_by_s: float
    """Monotonic time at which finishing work gives up."""
    stop_by_s: float
    """Monotonic time by which the clients are closed."""

    @classmethod
    def starting(cls, now_s: float, timeout_s: float) -> StopBudget:
        stop_by = now_s + timeout_s
        return cls(stop_by - (1.0 - STOP_WORK_SHARE) * timeout_s, stop_by)

    def working(self, now_s: float) -> bool:
        return now_s < self.work_by_s

    def work_left_s(self, now_s: float) -> float:
        return max(0.0, self.work_by_s - now_s)


def step_s(budget: StopBudget | None, now_s: float, steps: int) -> float:
    """Seconds for the next of `steps` shutdown steps left (at least MIN_STEP_S); CLIENT_STOP_S
    when there is no budget (the consumer ends by an error, not a stop)."""
    if budget is None:
        return CLIENT_STOP_S
    return max(MIN_STEP_S, (budget.stop_by_s - now_s) / steps)
