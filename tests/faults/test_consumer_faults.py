"""Faults of the consumer side: killed mid-batch, poison input, overload, rebalance storm.

Each test runs a scenario of `pipeline.tools.chaos` (the same code `batchtide
chaos` runs) against the real broker with consumers as real subprocesses,
and asserts the promise of the reliability issue: nothing lost, duplicates
within the at-least-once bound, and the scenario's own checks.
"""

from __future__ import annotations

import asyncio

import pytest

from pipeline.tools.chaos.consumer_kill import consumer_kill
from pipeline.tools.chaos.deployment import Stage
from pipeline.tools.chaos.ledger import FaultReport
from pipeline.tools.chaos.overload import overload
from pipeline.tools.chaos.poison import poison_request
from pipeline.tools.chaos.rebalance_storm import rebalance_storm
from pipeline.tools.chaos.share_consumer_kill import share_consumer_kill
from pipeline.tools.chaos.steps import ChaosSizes

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

SIZES = ChaosSizes.quick()


def assert_nothing_lost(report: FaultReport) -> None:
    assert report.requests_in > 0
    assert report.lost == 0, report.failures
    assert report.results_out == report.requests_in
    if report.duplicate_bound is not None:
        assert report.duplicated <= report.duplicate_bound
    assert report.failures == []


@pytest.mark.timeout(180)
def test_consumer_sigkill_mid_batch_loses_nothing(stage: Stage) -> None:
    report = asyncio.run(consumer_kill(stage, SIZES))
    assert_nothing_lost(report)
    assert report.details["reprocessed_by_survivor"] > 0, "the kill interrupted no work"
    assert report.duplicated <= report.details["answered_uncommitted_by_victim"]
    assert report.recovery_s is not None


@pytest.mark.timeout(180)
def test_share_consumer_sigkill_while_holding_records_loses_nothing(stage: Stage) -> None:
    report = asyncio.run(share_consumer_kill(stage, SIZES))
    assert_nothing_lost(report)
    assert report.details["held_by_victim"] > 0, "the kill caught no acquired record"
    assert report.details["duplicated_past_dedup"] == 0


@pytest.mark.timeout(120)
def test_poison_request_is_isolated_by_bisection(stage: Stage) -> None:
    report = asyncio.run(poison_request(stage, SIZES))
    assert_nothing_lost(report)
    assert report.injections >= 2
    assert report.details["dead_lettered"] == report.injections
    assert report.details["outcomes"]["error"] == report.injections
    assert report.details["outcomes"]["ok"] == report.requests_in - report.injections
    assert report.details["healthy_batch_mates_ok"] > 0


@pytest.mark.timeout(180)
def test_overload_expires_instead_of_running_late(stage: Stage) -> None:
    report = asyncio.run(overload(stage, SIZES))
    assert_nothing_lost(report)
    d = report.details
    assert d["outcomes"]["expired"] > 0 and d["outcomes"]["ok"] > 0
    assert d["dispatched_after_deadline"] == 0
    assert d["ok_p99_ms"] <= d["late_bound_ms"]
    assert d["rss_growth_mb"] < 150
    assert d["ok_rps_during"] >= 0.5 * d["capacity_rps"]
    assert report.recovery_s is not None


@pytest.mark.timeout(180)
def test_rebalance_storm_loses_nothing(stage: Stage) -> None:
    report = asyncio.run(rebalance_storm(stage, SIZES))
    assert_nothing_lost(report)
    assert report.details["joins"] >= 2 and report.details["leaves"] >= 1
    assert report.duplicated == 0
