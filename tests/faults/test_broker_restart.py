"""The broker goes away and comes back on the same data directory.

The test owns its broker (fixture `own_broker_stage`): the shared session
broker is never stopped. Consumers, the sink and the harness's producer and
reader stay up across the outage and must reconnect by themselves.
"""

from __future__ import annotations

import asyncio

import pytest

from pipeline.tools.chaos.broker_restart import broker_restart
from pipeline.tools.chaos.deployment import Stage
from pipeline.tools.chaos.steps import ChaosSizes

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.mark.timeout(240)
def test_broker_restart_loses_no_request_and_no_event(own_broker_stage: Stage) -> None:
    sizes = ChaosSizes.quick()
    report = asyncio.run(broker_restart(own_broker_stage, sizes))
    assert report.failures == []
    assert report.lost == 0
    assert report.results_out == report.requests_in > 0
    d = report.details
    assert d["outage_s"] >= sizes.outage_s
    assert d["events_lost"] == 0 and d["events_double_counted"] == 0
    assert d["rows"] == d["events_expected"]
    assert report.recovery_s is not None and d["events_recovery_s"] is not None
