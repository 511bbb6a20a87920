"""The catalogue of faults and the runner behind `batchtide chaos`.

Adding a fault: one module with `async def my_fault(stage, sizes) -> FaultReport`, and one line in SCENARIOS.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.chaos.broker_restart import broker_restart
from pipeline.chaos.clickhouse_outage import clickhouse_outage
from pipeline.chaos.consumer_kill import consumer_kill, consumer_kill_transactional
from pipeline.chaos.harness import ChaosSizes, Stage
from pipeline.chaos.hostile_input import hostile_input
from pipeline.chaos.ledger import FaultReport
from pipeline.chaos.overload import overload
from pipeline.chaos.poison import poison_request
from pipeline.chaos.rebalance_storm import rebalance_storm
from pipeline.chaos.sink_kill import sink_kill
from pipeline.config import KafkaSettings
from pipeline.devtools.localkafka import LocalKafka


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[Stage, ChaosSizes], Awaitable[FaultReport]]
    restarts_broker: bool = False
    """Stops the broker: must run on a broker nobody else uses."""


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("consumer-kill", consumer_kill),
        Scenario("consumer-kill-txn", consumer_kill_transactional),
        Scenario("broker-restart", broker_restart, restarts_broker=True),
        Scenario("clickhouse-outage", clickhouse_outage),
        Scenario("sink-kill", sink_kill),
        Scenario("poison", poison_request),
        Scenario("overload", overload),
        Scenario("rebalance-storm", rebalance_storm),
        Scenario("hostile-input", hostile_input),
    )
}


async def run_scenarios(names: list[str], sizes: ChaosSizes, workdir: Path) -> list[FaultReport]:
    """Run scenarios one after another on a private broker started in `workdir`."""
    broker = LocalKafka(workdir / "kafka")
    await asyncio.to_thread(broker.start, 120.0)
    reports: list[FaultReport] = []
    try:
        for name in names:
            scenario = SCENARIOS[name]
            stage = Stage(
                workdir=workdir / name,
                kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, topic_prefix=f"chaos-{name}-{uuid.uuid4().hex[:6]}"),
                broker=broker if scenario.restarts_broker else None,
            )
            stage.workdir.mkdir(parents=True, exist_ok=True)
            if not broker.is_running:
                await asyncio.to_thread(broker.start, 120.0)
            try:
                reports.append(await scenario.run(stage, sizes))
            except Exception as e:  # noqa: BLE001 - one broken scenario must not hide the others' rows
                reports.append(FaultReport.harness_error(name, e))
    finally:
        await asyncio.to_thread(broker.stop)
    return reports


def report_rows(reports: list[FaultReport]) -> list[dict[str, Any]]:
    """Plain dicts for `--json` (and for anyone who wants the table as data)."""
    return [
        {
            "fault": r.fault,
            "injections": r.injections,
            "requests_in": r.requests_in,
            "results_out": r.results_out,
            "lost": r.lost,
            "duplicated": r.duplicated,
            "duplicate_bound": r.duplicate_bound,
            "recovery_s": r.recovery_s,
            "passed": r.passed,
            "failures": r.failures,
            "details": r.details,
        }
        for r in reports
    ]
