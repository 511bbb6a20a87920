"""The catalogue of faults and the runner behind `batchtide chaos`.

Adding a fault: one module with `async def my_fault(stage, sizes) -> FaultReport`, and one line in SCENARIOS.
The cluster rows (CLUSTER) run on a three-broker cluster of their own, started once for all of them.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.config import KafkaSettings
from pipeline.tools.chaos.broker_restart import broker_restart
from pipeline.tools.chaos.clickhouse_outage import clickhouse_outage
from pipeline.tools.chaos.cluster_faults import (
    broker_freeze,
    controller_kill,
    coordinator_freeze,
    leader_kill,
    rolling_restart,
    share_broker_freeze,
    share_leader_kill,
    share_rolling_restart,
)
from pipeline.tools.chaos.consumer_kill import consumer_kill, consumer_kill_transactional
from pipeline.tools.chaos.deployment import Stage
from pipeline.tools.chaos.hostile_input import hostile_input
from pipeline.tools.chaos.ledger import FaultReport
from pipeline.tools.chaos.overload import overload
from pipeline.tools.chaos.poison import poison_request
from pipeline.tools.chaos.rebalance_storm import rebalance_storm
from pipeline.tools.chaos.share_consumer_kill import share_consumer_kill
from pipeline.tools.chaos.sink_kill import sink_kill
from pipeline.tools.chaos.steps import ChaosSizes
from pipeline.tools.devtools.localcluster import LocalCluster
from pipeline.tools.devtools.localkafka import LocalKafka

CLUSTER_BROKERS = 3


@dataclass(frozen=True)
class FaultScenario:
    name: str
    run: Callable[[Stage, ChaosSizes], Awaitable[FaultReport]]
    restarts_broker: bool = False
    """Stops the broker: must run on a broker nobody else uses."""
    cluster: bool = False
    """Runs on a three-broker cluster (whose brokers it kills, freezes or restarts)."""
    share: bool = False
    """Runs the consumers in a share group (needs Kafka 4.2+): `batchtide chaos share`, not `all` or `cluster`."""

    @property
    def summary(self) -> str:
        """One line for `chaos --list`: the first clause of the fault's docstring (up to the first
        sentence's end, colon or semicolon outside parentheses), never a line cut mid-sentence."""
        text = " ".join((self.run.__doc__ or "").split("\n\n")[0].split())
        for end in re.finditer(r"[.:;](?=\s)", text):
            head = text[: end.start()]
            if head.count("(") == head.count(")"):
                return head
        return text.rstrip(".")


SCENARIOS: dict[str, FaultScenario] = {
    s.name: s
    for s in (
        FaultScenario("consumer-kill", consumer_kill),
        FaultScenario("consumer-kill-txn", consumer_kill_transactional),
        FaultScenario("broker-restart", broker_restart, restarts_broker=True),
        FaultScenario("clickhouse-outage", clickhouse_outage),
        FaultScenario("sink-kill", sink_kill),
        FaultScenario("poison", poison_request),
        FaultScenario("overload", overload),
        FaultScenario("rebalance-storm", rebalance_storm),
        FaultScenario("hostile-input", hostile_input),
        FaultScenario("leader-kill", leader_kill, cluster=True),
        FaultScenario("broker-freeze", broker_freeze, cluster=True),
        FaultScenario("coordinator-freeze", coordinator_freeze, cluster=True),
        FaultScenario("rolling-restart", rolling_restart, cluster=True),
        FaultScenario("controller-kill", controller_kill, cluster=True),
        FaultScenario("share-consumer-kill", share_consumer_kill, share=True),
        FaultScenario("share-leader-kill", share_leader_kill, cluster=True, share=True),
        FaultScenario("share-broker-freeze", share_broker_freeze, cluster=True, share=True),
        FaultScenario("share-rolling-restart", share_rolling_restart, cluster=True, share=True),
    )
}
SINGLE_BROKER = [name for name, s in SCENARIOS.items() if not s.cluster and not s.share]
"""`batchtide chaos all`."""
CLUSTER = [name for name, s in SCENARIOS.items() if s.cluster and not s.share]
"""`batchtide chaos cluster`."""
SHARE = [name for name, s in SCENARIOS.items() if s.share]
"""`batchtide chaos share`: the share-group rows (single broker first, then the cluster's)."""


async def run_scenarios(names: list[str], sizes: ChaosSizes, workdir: Path) -> list[FaultReport]:
    """Run scenarios one after another: the single-broker ones on a private broker, the cluster
    ones on a private three-broker cluster, each started in `workdir` only if a scenario needs it."""
    broker = LocalKafka(workdir / "kafka")
    cluster = LocalCluster(workdir / "cluster", brokers=CLUSTER_BROKERS)
    reports: list[FaultReport] = []
    try:
        for name in names:
            scenario = SCENARIOS[name]
            if scenario.cluster:
                if broker.is_running:
                    await asyncio.to_thread(broker.stop)
                await asyncio.to_thread(cluster.start, 180.0)
                bootstrap = cluster.bootstrap
            else:
                await asyncio.to_thread(broker.start, 120.0)
                bootstrap = broker.bootstrap
            stage = Stage(
                workdir=workdir / name,
                kafka=KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"chaos-{name}-{uuid.uuid4().hex[:6]}"),
                broker=broker if scenario.restarts_broker else None,
                cluster=cluster if scenario.cluster else None,
            )
            stage.workdir.mkdir(parents=True, exist_ok=True)
            try:
                reports.append(await scenario.run(stage, sizes))
            except Exception as e:
                reports.append(FaultReport.harness_error(name, e))
    finally:
        await asyncio.to_thread(broker.stop)
        await asyncio.to_thread(cluster.stop)
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
