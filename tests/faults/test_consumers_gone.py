"""Every consumer of a model dies under load: the no-consumer alert fires from the recorded data.

Real consumer processes, the real sink (`batchtide sink`), the real broker; the
rule is the generated one, evaluated as Grafana would on what the sink stored
(read through its live read-only server). A consumer records its own lag only
while it lives, so this can only work if the sink samples the group from the
broker: with one consumer of two killed the rule must stay quiet, with both
killed it must fire once the group has been empty for its window.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from clickhouse_connect.driver.client import Client

from dashboards.alerts import provisioning
from pipeline.core.config import ClickHouseSettings, parse_config
from pipeline.core.store.connection import connect_reader
from pipeline.tools.chaos.deployment import CHAOS_MODEL, CostModelDevice, Deployment, Stage
from tests.dashboards.test_alerts import _rule, evaluate

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

NO_MEMBER_S = 12.0
SAMPLE_MS = 1000.0
SESSION_S = 10.0
"""A SIGKILLed consumer stays a member until the broker's session timeout (aiokafka's default) evicts it."""
RATE_RPS = 40.0
RULE = _rule(
    provisioning(parse_config({
        "models": {CHAOS_MODEL: {"runner": "cost-model"}},
        "clickhouse": {"group_lag_interval_ms": SAMPLE_MS},
        "alerts": {"no_member_s": NO_MEMBER_S},
    })),
    "batchtide-no-consumer",
)  # fmt: skip


def _fired(d: Deployment) -> dict[str, bool]:
    reader: Client = connect_reader(ClickHouseSettings(data_dir=str(d.clickhouse_dir)), database="batchtide")
    try:
        return evaluate(reader, RULE, int(time.time() * 1000))
    finally:
        reader.close()


async def _watch(d: Deployment, seconds: float) -> list[dict[str, bool]]:
    """The rule's verdict about once a second for `seconds`."""
    verdicts = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        d.check_alive()
        verdicts.append(await asyncio.to_thread(_fired, d))
        await asyncio.sleep(1.0)
    return verdicts


async def _scenario(stage: Stage) -> dict[str, Any]:
    async with Deployment(stage, CostModelDevice(), clickhouse={"group_lag_interval_ms": SAMPLE_MS}) as d:
        survivor, doomed = d.consumer("c1"), d.consumer("c2")
        d.sink()
        await d.warm_up(consumers=2)
        await d.sink_ready(90)
        stopping = False
        sending = asyncio.create_task(d.traffic.open_loop(100_000, RATE_RPS, until=lambda: stopping))
        try:
            both = await _watch(d, NO_MEMBER_S + 3)
            doomed.kill()
            one = await _watch(d, SESSION_S + NO_MEMBER_S + 5)
            survivor.kill()
            killed = time.monotonic()
            deadline = killed + SESSION_S + NO_MEMBER_S + 20
            none: list[dict[str, bool]] = []
            while time.monotonic() < deadline and not (none and none[-1].get(CHAOS_MODEL)):
                none += await _watch(d, 1.0)
            return {"both": both, "one": one, "none": none, "fired_after_s": time.monotonic() - killed}
        finally:
            stopping = True
            await sending


@pytest.mark.timeout(300)
def test_no_consumer_alert_fires_when_every_consumer_is_gone(stage: Stage) -> None:
    seen = asyncio.run(_scenario(stage))
    assert seen["both"] and all(v == {CHAOS_MODEL: False} for v in seen["both"]), seen["both"]
    assert seen["one"] and all(v == {CHAOS_MODEL: False} for v in seen["one"]), "one consumer still serves"
    assert seen["none"][-1] == {CHAOS_MODEL: True}, f"the rule never fired: {seen['none'][-5:]}"
    assert seen["fired_after_s"] >= NO_MEMBER_S, "it must wait out its window, not fire on the first empty sample"
