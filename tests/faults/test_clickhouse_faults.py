"""Faults of the observability path: the sink killed, ClickHouse away.

Inference never waits on ClickHouse; events wait in Kafka until the sink has
inserted them, so neither fault may lose an event or count one twice.
"""

from __future__ import annotations

import asyncio

import pytest

from pipeline.tools.chaos.clickhouse_outage import clickhouse_outage
from pipeline.tools.chaos.deployment import Stage
from pipeline.tools.chaos.ledger import FaultReport
from pipeline.tools.chaos.sink_kill import sink_kill
from pipeline.tools.chaos.steps import ChaosSizes

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

SIZES = ChaosSizes.quick()


def _every_request_and_event_once(report: FaultReport) -> dict:
    """Nothing lost, nothing doubled: every request answered, every latency event one ClickHouse row."""
    assert report.failures == []
    assert report.lost == 0 and report.duplicated == 0
    assert report.results_out == report.requests_in > 0
    d = report.details
    assert d["events_lost"] == 0 and d["events_double_counted"] == 0
    assert d["rows"] == d["events_expected"] >= report.requests_in
    return d


@pytest.mark.timeout(240)
def test_sink_sigkill_loses_and_doubles_no_event(stage: Stage) -> None:
    report = asyncio.run(sink_kill(stage, SIZES))
    _every_request_and_event_once(report)
    assert report.recovery_s is not None


@pytest.mark.timeout(240)
def test_clickhouse_outage_stalls_only_the_sink(stage: Stage) -> None:
    report = asyncio.run(clickhouse_outage(stage, SIZES))
    d = _every_request_and_event_once(report)
    served, during = (int(x) for x in d["served_during_outage"].split("/"))
    assert during > 0 and served >= 0.95 * during
    assert d["outage_s"] >= SIZES.outage_s
    assert report.recovery_s is not None
