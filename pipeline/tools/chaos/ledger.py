"""The ledger: every request id sent, every answer seen for it, and the row of the chaos table it adds up to.

Lost and duplicated are counted here and only here, for every fault alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.kafka.first_answers import DEFAULT_WINDOW_MS, FirstAnswers
from schemas.messages import DeadLetter, LatencyEvent, Result


@dataclass
class FaultReport:
    """One row of the chaos table, plus the figures behind its verdict."""

    fault: str
    injections: int
    requests_in: int
    results_out: int
    """Distinct request ids answered (a Result, or a dead letter for rejected input)."""
    lost: int
    duplicated: int
    """Extra Results beyond the first per request id."""
    duplicate_bound: int | None
    """Most duplicates the scenario's promise allows (None: duplicates are reported, not bounded)."""
    recovery_s: float | None
    failures: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.failures

    @classmethod
    def harness_error(cls, fault: str, error: BaseException) -> FaultReport:
        """The row of a scenario the harness could not run: no figures, one failure naming the error."""
        return cls(fault, 0, 0, 0, 0, 0, None, None, failures=[f"harness error: {type(error).__name__}: {error}"])


@dataclass(frozen=True)
class SeenAnswer:
    at: float
    """Wall-clock seconds when the harness saw the Result."""
    outcome: str
    consumer_id: str | None
    batch_id: int | None
    enqueue_ms: int
    done_ms: int


class Ledger:
    """Every id sent, and every Result and dead letter seen for it."""

    def __init__(self) -> None:
        self.sent: dict[str, float] = {}
        self.results: dict[str, list[SeenAnswer]] = {}
        self.dead: dict[str, list[DeadLetter]] = {}
        self.dispatched_ms: dict[str, int] = {}
        """When the consumer put each request into a batch (first LatencyEvent; collected on demand)."""
        self._first_answer: dict[str, float] = {}

    def record_sent(self, request_id: str, at: float) -> None:
        self.sent[request_id] = at

    def record_result(self, result: Result, at: float) -> None:
        answer = SeenAnswer(at, result.outcome, result.consumer_id, result.batch_id, result.enqueue_ms, result.done_ms)
        self.results.setdefault(result.id, []).append(answer)
        self._first_answer.setdefault(result.id, at)

    def record_timing(self, event: LatencyEvent) -> None:
        if event.outcome == "ok":
            self.dispatched_ms.setdefault(event.request_id, event.dispatch_ms)

    def record_dead(self, letter: DeadLetter, at: float) -> None:
        if letter.request_id is None:
            return
        self.dead.setdefault(letter.request_id, []).append(letter)
        self._first_answer.setdefault(letter.request_id, at)

    def unanswered(self, ids: Iterable[str] | None = None) -> list[str]:
        return [i for i in (self.sent if ids is None else ids) if i not in self._first_answer]

    @property
    def answered_count(self) -> int:
        return sum(1 for i in self.sent if i in self._first_answer)

    @property
    def duplicated(self) -> int:
        return sum(len(answers) - 1 for i, answers in self.results.items() if i in self.sent and len(answers) > 1)

    def duplicated_ids(self) -> list[str]:
        return [i for i, answers in self.results.items() if i in self.sent and len(answers) > 1]

    def outcomes(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for i, answers in self.results.items():
            if i in self.sent:
                counts[answers[0].outcome] = counts.get(answers[0].outcome, 0) + 1
        return counts

    def caught_up_at(self, moment: float) -> float | None:
        """When every request sent before `moment` had its first answer (None: not all have)."""
        latest = moment
        for request_id, sent_at in self.sent.items():
            if sent_at > moment:
                continue
            first = self._first_answer.get(request_id)
            if first is None:
                return None
            latest = max(latest, first)
        return latest

    def recovery_after(self, fault_end: float) -> float | None:
        caught_up = self.caught_up_at(fault_end)
        return None if caught_up is None else round(caught_up - fault_end, 2)

    def p99_by_phase(self, start: float, end: float) -> dict[str, float]:
        """p99 in ms of what a client waits (send until the first answer is seen; read_committed, so
        a transactional answer counts once it is committed) for requests sent before `start`, during
        [start, end] and after `end`. Unanswered requests are left out (they are counted as lost)."""
        phases: dict[str, list[float]] = {"before": [], "during": [], "after": []}
        for request_id, sent_at in self.sent.items():
            first = self._first_answer.get(request_id)
            if first is None:
                continue
            phase = "before" if sent_at < start else "during" if sent_at <= end else "after"
            phases[phase].append((first - sent_at) * 1000.0)
        return {f"p99_{name}_ms": round(percentile(values, 99), 1) for name, values in phases.items()}

    def duplicated_past_dedup(self, window_ms: int = DEFAULT_WINDOW_MS) -> int:
        """Repeated Results a reader keeping the first answer per id (`FirstAnswers`, by the time the
        harness saw each) would still hand out: repeats later than its window after the first."""
        reader = FirstAnswers(window_ms)
        seen = sorted((answer.at, request_id) for request_id, answers in self.results.items() for answer in answers)
        firsts: dict[str, int] = {}
        for at, request_id in seen:
            if reader.first(request_id, int(at * 1000)):
                firsts[request_id] = firsts.get(request_id, 0) + 1
        return sum(n - 1 for n in firsts.values())

    def report(
        self,
        fault: str,
        injections: int,
        *,
        fault_end: float | None,
        duplicate_bound: int | None = 0,
        failures: list[str] | None = None,
        details: dict[str, Any] | None = None,
        events: EventTally | None = None,
    ) -> FaultReport:
        """Turn the ledger into a report row; every broken promise becomes a failure line.

        `events`: what reached ClickHouse, for the scenarios that check the sink;
        its lost and double-counted events add to the row's lost and duplicated.
        """
        lost = len(self.unanswered())
        duplicated = self.duplicated
        problems = list(failures or [])
        events_lost, events_double = (events.lost, events.double) if events else (0, 0)
        if events_lost:
            problems.append(f"{events_lost} latency events never reached ClickHouse")
        if events_double:
            problems.append(f"{events_double} latency events counted twice")
        if lost:
            sample = ", ".join(self.unanswered()[:5])
            problems.append(f"{lost} requests never answered (e.g. {sample})")
        if duplicate_bound is not None and duplicated > duplicate_bound:
            problems.append(f"{duplicated} duplicate results, more than the bound {duplicate_bound}")
        return FaultReport(
            fault=fault,
            injections=injections,
            requests_in=len(self.sent),
            results_out=self.answered_count,
            lost=lost + events_lost,
            duplicated=duplicated + events_double,
            duplicate_bound=duplicate_bound,
            recovery_s=self.recovery_after(fault_end) if fault_end is not None else None,
            failures=problems,
            details={"outcomes": self.outcomes(), **(details or {}), **(events.details if events else {})},
        )


@dataclass
class EventTally:
    """What reached ClickHouse after a fault on the events path."""

    caught_up: float | None
    """Wall-clock time the sink had committed every event produced before the fault ended (None: never)."""
    lost: int
    double: int
    details: dict[str, Any]

    def recovery_after(self, moment: float) -> float | None:
        return None if self.caught_up is None else round(self.caught_up - moment, 2)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100.0 * len(ordered) + 0.5) - 1))
    return ordered[rank]
