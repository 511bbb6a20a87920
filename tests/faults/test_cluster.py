"""A broker of a three-broker cluster lost under load: killed as leader and transaction
coordinator, or frozen (SIGSTOP) as a zombie leader.

Each test owns its cluster (fixture `cluster_stage`, the code `batchtide local
up --brokers 3` runs). Two transactional consumers, the sink and the harness's
read_committed reader stay up throughout and are never restarted by hand; the
promise is stricter than the single broker's: every request answered exactly
once, every latency event exactly one ClickHouse row. `batchtide chaos cluster`
runs these and the rolling-restart and controller-kill rows with longer sizes.
"""

from __future__ import annotations

import asyncio

import pytest

from pipeline.tools.chaos.cluster_faults import broker_freeze
from pipeline.tools.chaos.deployment import Stage
from pipeline.tools.chaos.leader_kill import MAX_RESEATS, leader_kill
from pipeline.tools.chaos.ledger import FaultReport
from pipeline.tools.chaos.steps import ChaosSizes

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

SIZES = ChaosSizes.quick()


def _exactly_once(report: FaultReport) -> dict:
    print(report.fault, report.details)  # shown by pytest -rA: the row's figures beside its verdict
    assert report.failures == [], report.details
    assert report.lost == 0 and report.duplicated == 0
    assert report.results_out == report.requests_in > 0
    d = report.details
    assert d["events_lost"] == 0 and d["events_double_counted"] == 0
    assert d["rows"] == d["events_expected"] >= report.requests_in
    assert report.recovery_s is not None and d["events_recovery_s"] is not None
    assert d["p99_during_ms"] > 0 and d["p99_after_ms"] > 0
    return d


@pytest.mark.timeout(300)
def test_killing_the_leader_and_transaction_coordinator_loses_and_doubles_nothing(cluster_stage: Stage) -> None:
    report = asyncio.run(leader_kill(cluster_stage, SIZES))
    d = _exactly_once(report)
    led, total = (int(x) for x in d["victim_led_request_partitions"].split("/"))
    assert led >= 1 and led * 3 >= total, "the victim must lead the most request partitions"
    assert d["victim_coordinated"].startswith(f"{cluster_stage.kafka.topic_prefix}.consumers.chaos.")
    assert d["down_s"] >= SIZES.outage_s
    assert 0 <= d["consumers_reseated"] <= MAX_RESEATS


@pytest.mark.timeout(300)
def test_a_frozen_leader_comes_back_as_a_follower_and_loses_nothing(cluster_stage: Stage) -> None:
    report = asyncio.run(broker_freeze(cluster_stage, SIZES))
    d = _exactly_once(report)
    assert d["frozen_s"] >= SIZES.freeze_s, d
    assert d["victim_led_request_partitions"] >= 1
    assert d["leaders_moved_s"] is not None, "the frozen leader's partitions got no new leader while it was frozen"
    assert d["victim_leads_only_as_preferred"], (
        f"the zombie must rejoin as a follower (leads {d['victim_leads_after']})"
    )
    assert d["fetch_stalls_unblocked"] >= 0
