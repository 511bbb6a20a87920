"""`batchtide replay`: recorded traffic read back from ClickHouse (the real engine, chDB)
and replayed through the simulator under candidate profiles.

The recording is made by running the simulator on a cost-model scenario and
storing every answered request and every batch through the sink's own writer
(request_latency, batches), as a consumer group would have. Replaying it under
the profile that ran must reproduce the recording (--validate exits 0); under
a config that says another profile ran, it must not (exit 1).
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.core.config import BatchProfile, ClickHouseSettings
from pipeline.core.engine import BatchingEngine
from pipeline.core.sim.arrivals import Arrivals, make_arrivals
from pipeline.core.sim.scenario_file import load_scenario, parse_scenario
from pipeline.core.sim.simulator import RunOutcome, simulate
from pipeline.core.store.connection import connect
from pipeline.core.store.traffic import read_traffic
from pipeline.core.store.writer import insert_batch_events, insert_latency_events
from pipeline.tools.bench.replay import ReplayError, replay
from schemas.messages import BatchEvent, LatencyEvent
from tests.support.clickhouse import SeededClickHouse

HOPS_MS = 3.0
"""Kafka hops outside the device that the recording adds to every request."""
RAN = BatchProfile(hard_cap=32, target_size=24, tail_mark_ratio=0.0)

SCENARIO = {
    "name": "recorded",
    "slo_p99_ms": 1000.0,
    "seed": 5,
    "phases": [
        {"duration_s": 6, "rate_per_s": 150},
        {"duration_s": 6, "rate_per_s": 600, "bursts": {"every_s": 3, "duration_s": 0.5, "rate_per_s": 1000}},
        {"duration_s": 4, "rate_per_s": 200},
    ],
    "tokens": {"prompt": {"dist": "uniform", "min": 8, "max": 64}},
    "cost": {"a_ms": 20.0, "c_ms": 1.5},
    "topology": {"mode": "own-queues", "consumers": 2, "assignment": "random"},
    "priority": {"mix": [0.2, 0.8]},
}


def _record(client, database: str, arrivals: Arrivals, outcome: RunOutcome, start_ms: int) -> None:
    """Store a simulated run the way the sink stores a live one."""
    latency: list[LatencyEvent] = []
    batches: list[BatchEvent] = []
    log = outcome.batches
    members: dict[tuple[int, float], list[int]] = {}
    for i in range(len(arrivals)):
        members.setdefault((int(arrivals.lane[i]), float(outcome.dispatch_ms[i])), []).append(i)
    for b in range(len(log.size)):
        lane, dispatch = log.lane[b], log.dispatch_ms[b]
        consumer = f"sim-{lane}"
        batches.append(
            BatchEvent(
                batch_id=b + 1,
                model="m",
                consumer_id=consumer,
                dispatch_ms=start_ms + int(dispatch),
                size=log.size[b],
                cost=log.size[b],
                reason="hard_cap",
                window_ms=log.window_ms[b],
                hit_target=log.hit_target[b],
                target_size=24,
                marked_count=log.marked[b],
                oldest_wait_ms=0.0,
                queue_depth=0,
                effective_cap=log.effective_cap[b],
                cap_reason="configured",
                arrival_rate_per_s=0.0,
                compute_ms=log.compute_ms[b],
                tokens_in=0,
                tokens_out=0,
                device_mem_bytes=0,
                device_mem_kind="none",
            )
        )
        for i in members[(lane, dispatch)]:
            create, done = float(arrivals.create_ms[i]), float(outcome.done_ms[i])
            latency.append(
                LatencyEvent(
                    request_id=f"r{i}",
                    model="m",
                    consumer_id=consumer,
                    outcome="ok",
                    enqueue_ms=start_ms + round(create),
                    fetch_ms=start_ms + round(create),
                    dispatch_ms=start_ms + round(dispatch),
                    compute_start_ms=start_ms + round(dispatch),
                    compute_end_ms=start_ms + round(done),
                    produce_ms=start_ms + round(done + HOPS_MS),
                    wait_ms=dispatch - create,
                    compute_ms=done - dispatch,
                    e2e_ms=done + HOPS_MS - create,
                    batch_id=b + 1,
                    batch_size=log.size[b],
                    tail_marked=bool(outcome.marked[i]),
                    priority=int(arrivals.priority[i]),
                    tokens_in=int(arrivals.tokens[i]),
                    tokens_out=0,
                    device_mem_bytes=0,
                    device_mem_kind="none",
                    partition=int(arrivals.lane[i]),
                    offset=i,
                )
            )
    # a warm-up request (a cold model: 30 s) is stored like any other but replays nothing
    latency.append(
        msgspec.structs.replace(latency[0], request_id="warm-up", e2e_ms=30_000.0, wait_ms=29_000.0, warmup=True)
    )
    assert insert_latency_events(client, database, latency) == len(arrivals) + 1
    assert insert_batch_events(client, database, batches) == len(log.size)


@pytest.fixture(scope="module")
def recorded(clickhouse_client, clickhouse_settings: ClickHouseSettings, tmp_path_factory):
    database = "replay_recorded"
    clickhouse_client.command(f"DROP DATABASE IF EXISTS {database} SYNC")
    from pipeline.core.store.migrations import Layout, migrate

    migrate(clickhouse_client, Layout(database))
    scenario = parse_scenario(SCENARIO, "recorded.toml")
    arrivals = make_arrivals(scenario)
    engines = [BatchingEngine(RAN) for _ in range(scenario.topology.lanes)]
    outcome = simulate(scenario, arrivals, engines)
    start_ms = int(time.time() * 1000) - 60_000
    _record(clickhouse_client, database, arrivals, outcome, start_ms)
    config = tmp_path_factory.mktemp("replay") / "batchtide.toml"
    config.write_text(
        f'[clickhouse]\ndata_dir = "{clickhouse_settings.data_dir}"\ndatabase = "{database}"\n\n'
        '[models.m]\nrunner = "cost-model"\nhard_cap = 32\ntarget_size = 24\ntail_mark_ratio = 0\n'
    )
    yield {"database": database, "config": config, "arrivals": arrivals, "outcome": outcome, "start_ms": start_ms}
    clickhouse_client.command(f"DROP DATABASE IF EXISTS {database} SYNC")


def test_traffic_reads_back_exactly_what_was_recorded(recorded, clickhouse_settings: ClickHouseSettings) -> None:
    client = connect(clickhouse_settings, database=recorded["database"])
    now = int(time.time() * 1000)
    traffic = read_traffic(client, recorded["database"], "m", now - 3_600_000, now)
    client.close()
    arrivals = recorded["arrivals"]
    assert len(traffic) == len(arrivals)
    expected = np.sort(np.round(arrivals.create_ms).astype(np.int64) + recorded["start_ms"])
    assert np.array_equal(traffic.enqueue_ms.astype(np.int64), expected)
    assert traffic.consumers == ["sim-0", "sim-1"]
    assert traffic.batch_size.sum() == len(arrivals)
    assert sorted(set(traffic.priority.tolist())) == [0, 1]
    assert traffic.stamped, "every batch's answers carry compute stamps"
    assert np.all(traffic.batch_start_gap_ms == 0.0)
    assert np.abs(traffic.batch_publish_gap_ms - HOPS_MS).max() <= 1.0
    log = recorded["outcome"].batches
    assert np.array_equal(
        np.sort(traffic.batch_dispatch_ms - recorded["start_ms"]), np.sort(np.asarray(log.dispatch_ms).astype(np.int64))
    )


def test_replay_predicts_the_profile_that_ran_and_ranks_candidates(recorded, clickhouse_settings) -> None:
    client = connect(clickhouse_settings, database=recorded["database"])
    now = int(time.time() * 1000)
    traffic = read_traffic(client, recorded["database"], "m", now - 3_600_000, now)
    client.close()
    result = replay(traffic, RAN, replays=3)
    assert result.parts == ("device speed", "start gap", "publish gap") and result.replays == 3
    assert result.ran.name == "ran" and result.ran.profile == RAN
    assert result.recorded.overhead_ms == pytest.approx(HOPS_MS, abs=1.0)
    check = result.validation()
    assert abs(check["p99_ratio"] - 1) < 0.15 and abs(check["throughput_ratio"] - 1) < 0.15, check
    names = [p.name for p in result.predictions]
    assert {"auto cap", "hard_cap 16", "hard_cap 128"} <= set(names)
    assert result.recommended().p99_ms == min(
        p.p99_ms
        for p in result.predictions
        if p.throughput_rps >= 0.99 * max(q.throughput_rps for q in result.predictions)
    )


def test_cli_validate_passes_for_the_profile_that_ran_and_exports_a_scenario(recorded, tmp_path: Path) -> None:
    export = tmp_path / "window.toml"
    result = CliRunner().invoke(
        app, ["replay", "--since", "1h", "--config", str(recorded["config"]), "--validate", "--export", str(export)]
    )
    assert result.exit_code == 0, result.output
    assert "recommended:" in result.output and "within 15%: agree" in result.output
    assert "replayed 9x per candidate; added from the recording: device speed, start gap, publish gap" in (
        " ".join(result.output.split())
    )
    scenario = load_scenario(export)
    assert scenario.topology.consumers == 2
    assert abs(sum(p.rate_per_s * p.duration_s for p in scenario.phases) - len(recorded["arrivals"])) <= 1


def test_cli_validate_fails_when_the_config_is_not_what_ran(recorded, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(
        recorded["config"]
        .read_text()
        .replace("hard_cap = 32", "hard_cap = 2")
        .replace("target_size = 24", "target_size = 2")
    )
    result = CliRunner().invoke(app, ["replay", "--since", "1h", "--config", str(wrong), "--validate"])
    assert result.exit_code == 1, result.output
    assert "DISAGREE" in result.output


def test_replay_of_seeded_traffic_runs_and_an_empty_window_says_so(seeded_clickhouse: SeededClickHouse) -> None:
    s = seeded_clickhouse
    model = s.summary.models[0]
    traffic = read_traffic(s.client, s.database, model, s.time_from_ms, s.time_from_ms + 60_000)
    assert len(traffic) > 0
    result = replay(traffic, BatchProfile())
    assert all(p.throughput_rps > 0 and p.p99_ms > 0 for p in result.predictions)
    empty = read_traffic(s.client, s.database, "no-such-model", s.time_from_ms, s.time_to_ms)
    with pytest.raises(ReplayError, match="no requests of model 'no-such-model'"):
        replay(empty, BatchProfile())
