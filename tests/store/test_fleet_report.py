"""Refusals and consumers in `report`: figures equal numpy's on the seeded rows themselves.

The store is seeded with one slow consumer per model (Fleet.slow_factor) and refused requests on top
(Fleet.refused_share), plus lag samples that carry each consumer's measured capacity. Refusals must count
in every outcome share and in no latency figure; the by-consumer table must split p99, throughput and batch
size per member and show which one holds the tail.
"""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
from rich.console import Console

from pipeline.core.config import ClickHouseSettings
from pipeline.core.store.connection import connect
from pipeline.core.store.seed import generate, recent_start_ms
from pipeline.tools.views.report import Objective, Report, render, run_report
from tests.support.fleet_store import REFUSED, UNMEASURED, FleetStore

QUANTILES = [0.5, 0.99, 0.999]


@pytest.fixture(scope="module")
def fleet(fleet_clickhouse: FleetStore) -> FleetStore:
    return fleet_clickhouse


@pytest.fixture(scope="module")
def report(fleet: FleetStore) -> Report:
    return run_report(fleet.client, time_from_ms=fleet.time_from_ms, time_to_ms=fleet.time_to_ms,
                      objectives={"smollm": Objective(base_ms=300.0)})  # fmt: skip


def _rows(fleet: FleetStore, model: str) -> dict[str, np.ndarray]:
    mine = [c.latency for c in fleet.chunks if c.latency["model"][0] == model]
    return {k: np.concatenate([np.asarray(c[k]) for c in mine]) for k in mine[0]}


def _batches(fleet: FleetStore, model: str) -> dict[str, np.ndarray]:
    mine = [c.batches for c in fleet.chunks if c.batches["model"][0] == model]
    return {k: np.concatenate([np.asarray(c[k]) for c in mine]) for k in mine[0]}


def test_refusals_count_in_not_ok_and_in_no_latency_figure(fleet: FleetStore, report: Report) -> None:
    summary = {r["model"]: r for r in report.sections["summary"]}
    assert summary, "the report has no summary row: nothing would be checked"
    for model, row in summary.items():
        rows = _rows(fleet, model)
        refused = rows["outcome"] == "rejected"
        ran = ~refused
        assert refused.sum() > 100 and (rows["batch_size"][refused] == 0).all()
        assert row["refused"] == refused.sum()
        assert row["requests"] == ran.sum()
        assert row["not_ok_share"] == pytest.approx(np.mean(rows["outcome"] != "ok"), rel=1e-12)
        assert row["not_ok_share"] > REFUSED * 0.9, "refusals are in the not-ok share"
        e2e, wait = rows["e2e_ms"], rows["wait_ms"]
        assert [row["e2e_p50_ms"], row["e2e_p99_ms"], row["e2e_p999_ms"]] == pytest.approx(
            np.quantile(e2e[ran], QUANTILES), rel=1e-12)  # fmt: skip
        assert row["e2e_p50_ms"] != pytest.approx(np.quantile(e2e, 0.5), rel=1e-6) or row["wait_p50_ms"] != pytest.approx(
            np.quantile(wait, 0.5), rel=1e-6), "the refusals (answered in ms) would have moved a median"  # fmt: skip
        assert row["wait_p99_ms"] == pytest.approx(np.quantile(wait[ran], 0.99), rel=1e-12)
        assert row["marked_share"] == pytest.approx(np.mean(rows["tail_marked"][ran]), rel=1e-12)
        tokens = rows["tokens_in"][ran].sum() + rows["tokens_out"][ran].sum()
        assert row["tokens_per_s"] * row["span_s"] == pytest.approx(tokens, rel=1e-9)


def test_not_ok_by_outcome_and_reason(fleet: FleetStore, report: Report) -> None:
    for model in ("minilm", "smollm"):
        rows = _rows(fleet, model)
        not_ok = rows["outcome"] != "ok"
        expected = Counter(zip(rows["outcome"][not_ok].tolist(), rows["reason"][not_ok].tolist(), strict=True))
        got = {(r["outcome"], r["reason"]): r for r in report.sections["not_ok_reasons"] if r["model"] == model}
        assert {k: r["requests"] for k, r in got.items()} == dict(expected)
        assert {"rejected", "expired", "error"} <= {outcome for outcome, _ in got}
        for (outcome, reason), r in got.items():
            assert r["share"] == pytest.approx(expected[(outcome, reason)] / len(rows["outcome"]), rel=1e-12)
            assert r["cause"] == f"{outcome}: {reason}"


def test_slo_counts_a_refusal_as_a_miss(fleet: FleetStore, report: Report) -> None:
    rows = _rows(fleet, "smollm")
    (slo,) = [r for r in report.sections["slo"] if r["model"] == "smollm"]
    ok = rows["outcome"] == "ok"
    assert slo["requests"] == len(ok)
    assert slo["within_slo_share"] == pytest.approx(np.mean(ok & (rows["e2e_ms"] <= 300.0)), rel=1e-12)


def test_by_consumer_splits_latency_throughput_batch_size_and_capacity(fleet: FleetStore, report: Report) -> None:
    table = report.sections["consumers"]
    assert {r["consumer_id"] for r in table} == set(fleet.capacity) | {UNMEASURED}
    for model in ("minilm", "smollm"):
        rows, batches = _rows(fleet, model), _batches(fleet, model)
        mine = {r["consumer_id"]: r for r in table if r["model"] == model}
        assert len(mine) == 2
        ran = rows["outcome"] != "rejected"
        for consumer, r in mine.items():
            own = rows["consumer_id"] == consumer
            chosen = own & ran
            span_s = max((rows["produce_time"][own].max() - rows["enqueue_time"][own].min()) / 1000, 1)
            assert r["requests"] == chosen.sum()
            assert r["share"] == pytest.approx(chosen.sum() / ran.sum(), rel=1e-12)
            assert [r["e2e_p50_ms"], r["e2e_p99_ms"]] == pytest.approx(
                np.quantile(rows["e2e_ms"][chosen], [0.5, 0.99]), rel=1e-12)  # fmt: skip
            assert r["requests_per_s"] == pytest.approx(chosen.sum() / span_s, rel=1e-12)
            assert r["mean_batch_size"] == pytest.approx(
                batches["size"][batches["consumer_id"] == consumer].mean(), rel=1e-12
            )
            assert r["capacity_per_s"] == fleet.capacity.get(consumer), "the latest measured capacity, not a later 0"
            assert r["not_ok_share"] == pytest.approx(np.mean(rows["outcome"][own] != "ok"), rel=1e-12)
        assert sum(r["share"] for r in mine.values()) == pytest.approx(1.0)
        slow, fast = mine[f"{model}-c1"], mine[f"{model}-c0"]
        assert slow["e2e_p99_ms"] > 2 * fast["e2e_p99_ms"], "the slow device holds the tail"


def test_rendered_report_names_the_slow_consumer_first_and_shows_refusals(report: Report) -> None:
    out = io.StringIO()
    render(report, Console(file=out, width=80))
    text = out.getvalue()
    assert "Not ok by outcome and reason" in text and "rejected" in text and "too_long" in text
    for model in ("minilm", "smollm"):
        slow = {r["consumer_id"]: r for r in report.sections["consumers"] if r["model"] == model}[f"{model}-c1"]
        line = next(line for line in text.splitlines() if line.startswith(f"{model} by consumer: "))
        assert line.startswith(f"{model} by consumer: {model}-c1: p99 "), line
        shown = f"{slow['e2e_p99_ms'] / 1000:,.2f} s" if slow["e2e_p99_ms"] >= 1000 else f"{slow['e2e_p99_ms']:,.0f} ms"
        assert shown in line
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80


def test_a_request_without_a_batch_is_stored(clickhouse_settings: ClickHouseSettings, ch_database: str) -> None:
    """Consumers write batch_id -1 for a request that ran in no batch (expired in the queue, refused); the
    unsigned column stores it as 0 instead of failing the block (which the sink would retry forever)."""
    import msgspec

    from pipeline.core.store.seed import latency_events
    from pipeline.core.store.writer import NO_BATCH_ID, insert_latency_events

    chunk = next(iter(generate(20, seed=9, start_ms=recent_start_ms(60_000), duration_ms=60_000)))
    events = latency_events(chunk)
    refused = [msgspec.structs.replace(e, request_id=f"r-{i}", outcome="rejected", reason="too_long", batch_id=-1,
                                       batch_size=0, compute_ms=0.0) for i, e in enumerate(events[:3])]  # fmt: skip
    client = connect(clickhouse_settings, database=ch_database)
    try:
        assert insert_latency_events(client, ch_database, events + refused) == len(events) + 3
        stored = client.query(
            "SELECT batch_id, reason FROM request_latency WHERE outcome = 'rejected' ORDER BY request_id"
        ).result_rows
    finally:
        client.close()
    assert stored == [(NO_BATCH_ID, "too_long")] * 3
