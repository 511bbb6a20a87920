"""Bad input as a fault: the hostile corpus of `pipeline.tools.chaos.hostile_input` mixed into steady traffic
(the same code `batchtide chaos hostile-input` runs)."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.tools.chaos.deployment import Stage
from pipeline.tools.chaos.hostile_input import hostile_input
from pipeline.tools.chaos.steps import ChaosSizes

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.mark.timeout(180)
def test_hostile_input_is_all_accounted_for_and_never_stops_the_consumer(stage: Stage) -> None:
    report = asyncio.run(hostile_input(stage, ChaosSizes.quick()))
    assert report.failures == []
    assert report.requests_in > 0 and report.lost == 0 and report.duplicated == 0
    assert report.results_out == report.requests_in
    assert report.details["outcomes"] == {"ok": report.requests_in}
    details = report.details
    assert details["hostile_records"] == report.injections >= 3 * 14
    assert details["hostile_accounted"] == details["hostile_records"]
    assert details["truncated_dead_letters"] > 0 and details["rerouted_answers"] > 0
    assert details["consumer_restarts"] == 0
