"""`report` figures equal the same figures computed independently (numpy) from the generated rows."""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from typer.testing import CliRunner

from pipeline.core.config import ClickHouseSettings
from pipeline.core.store.connection import connect
from pipeline.core.store.seed import generate, latency_events, recent_start_ms
from pipeline.core.store.writer import insert_latency_events
from pipeline.tools.views.report import Objective, Report, pick_interval_ms, run_query, run_report
from tests.support.clickhouse import SeededClickHouse

QUANTILES = [0.5, 0.99, 0.999]


def _column(seeded: SeededClickHouse, table: str, model: str, name: str) -> np.ndarray:
    parts = [np.asarray(getattr(c, table)[name]) for c in seeded.chunks if getattr(c, table)["model"][0] == model]
    return np.concatenate(parts)


@pytest.fixture(scope="module")
def report(seeded_clickhouse: SeededClickHouse) -> Report:
    s = seeded_clickhouse
    return run_report(s.client, time_from_ms=s.time_from_ms, time_to_ms=s.time_to_ms, interval_ms=120_000)


def test_summary_matches_numpy(seeded_clickhouse: SeededClickHouse, report: Report) -> None:
    s = seeded_clickhouse
    rows = {r["model"]: r for r in report.sections["summary"]}
    assert sorted(rows) == sorted(s.summary.models)
    for model, row in rows.items():
        seconds = max(
            (_column(s, "latency", model, "produce_time").max() - _column(s, "latency", model, "enqueue_time").min())
            / 1000,
            1,
        )
        e2e = _column(s, "latency", model, "e2e_ms")
        wait = _column(s, "latency", model, "wait_ms")
        marked = _column(s, "latency", model, "tail_marked")
        tokens = _column(s, "latency", model, "tokens_in") + _column(s, "latency", model, "tokens_out")
        assert row["requests"] == len(e2e)
        assert row["span_s"] == pytest.approx(seconds, rel=1e-12)
        assert row["requests_per_s"] == pytest.approx(len(e2e) / seconds, rel=1e-12)
        assert row["tokens_per_s"] == pytest.approx(tokens.sum() / seconds, rel=1e-12)
        assert [row["e2e_p50_ms"], row["e2e_p99_ms"], row["e2e_p999_ms"]] == pytest.approx(
            np.quantile(e2e, QUANTILES), rel=1e-12
        )
        assert [row["wait_p50_ms"], row["wait_p99_ms"], row["wait_p999_ms"]] == pytest.approx(
            np.quantile(wait, QUANTILES), rel=1e-12
        )
        assert row["share_wait_over_1s"] == pytest.approx(np.mean(wait > 1000), rel=1e-12)
        assert row["marked_share"] == pytest.approx(np.mean(marked), rel=1e-12)
        assert row["marked_wait_p99_ms"] == pytest.approx(np.quantile(wait[marked], 0.99), rel=1e-12)
        assert row["unmarked_wait_p99_ms"] == pytest.approx(np.quantile(wait[~marked], 0.99), rel=1e-12)


def test_quantiles_per_bucket_match_numpy(seeded_clickhouse: SeededClickHouse, report: Report) -> None:
    s = seeded_clickhouse
    interval_s = report.interval_ms // 1000
    checked = 0
    for row in report.sections["latency_quantiles"]:
        enqueue = _column(s, "latency", row["model"], "enqueue_time")
        bucket = (enqueue // 1000) // interval_s * interval_s
        start = int(row["time"].replace(tzinfo=UTC).timestamp())
        chosen = bucket == start
        assert row["requests"] == int(chosen.sum())
        e2e, wait = (
            _column(s, "latency", row["model"], "e2e_ms")[chosen],
            _column(s, "latency", row["model"], "wait_ms")[chosen],
        )
        assert [row["e2e_p50_ms"], row["e2e_p99_ms"], row["e2e_p999_ms"]] == pytest.approx(
            np.quantile(e2e, QUANTILES), rel=1e-12
        )
        assert [row["wait_p50_ms"], row["wait_p99_ms"], row["wait_p999_ms"]] == pytest.approx(
            np.quantile(wait, QUANTILES), rel=1e-12
        )
        checked += 1
    assert checked >= 2 * 5, "10 minutes in 2-minute buckets, two models"
    throughput = report.sections["throughput"]
    assert sum(r["requests_per_s"] * interval_s for r in throughput) == pytest.approx(s.summary.rows, rel=1e-12)


def test_generation_figures_match_numpy(seeded_clickhouse: SeededClickHouse, report: Report) -> None:
    """Only the generating model has a row; its token rates and per-token times equal numpy's on the same rows."""
    s = seeded_clickhouse
    rows = {r["model"]: r for r in report.sections["generation"]}
    generating = [m for m in s.summary.models if _column(s, "latency", m, "first_token_time").any()]
    assert generating and sorted(rows) == sorted(generating)
    for model, row in rows.items():
        first = _column(s, "latency", model, "first_token_time")
        chosen = first > 0
        enqueue, produce = (
            _column(s, "latency", model, "enqueue_time")[chosen],
            _column(s, "latency", model, "produce_time")[chosen],
        )
        first, last = first[chosen], _column(s, "latency", model, "last_token_time")[chosen]
        tokens_in, tokens_out = (
            _column(s, "latency", model, "tokens_in")[chosen],
            _column(s, "latency", model, "tokens_out")[chosen],
        )
        assert (enqueue <= first).all() and (first <= last).all() and (last <= produce).all()
        seconds = max((produce.max() - enqueue.min()) / 1000, 1)
        assert row["requests"] == int(chosen.sum())
        assert row["prompt_tokens_per_s"] == pytest.approx(tokens_in.sum() / seconds, rel=1e-12)
        assert row["generated_tokens_per_s"] == pytest.approx(tokens_out.sum() / seconds, rel=1e-12)
        assert row["generated_tokens_per_s"] != pytest.approx(row["prompt_tokens_per_s"])
        assert [row["ttft_p50_ms"], row["ttft_p99_ms"]] == pytest.approx(
            np.quantile(first - enqueue, [0.5, 0.99]), rel=1e-12
        )
        many = tokens_out > 1
        tpot = (last - first)[many] / (tokens_out[many] - 1)
        assert [row["tpot_p50_ms"], row["tpot_p99_ms"]] == pytest.approx(np.quantile(tpot, [0.5, 0.99]), rel=1e-12)
        assert 0 < row["tpot_p50_ms"] < row["ttft_p50_ms"]
        timing = run_query(s.client, "token_timing", time_from_ms=s.time_from_ms, time_to_ms=s.time_to_ms,
                           interval_ms=report.interval_ms, model=model)  # fmt: skip
        interval_s = report.interval_ms / 1000
        assert len(timing) >= 5
        assert sum(r["generated_tokens_per_s"] for r in timing) * interval_s == pytest.approx(
            tokens_out.sum(), rel=1e-12
        )
        assert sum(r["prompt_tokens_per_s"] for r in timing) * interval_s == pytest.approx(tokens_in.sum(), rel=1e-12)
        assert all(r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["tpot_p50_ms"] <= r["tpot_p99_ms"] for r in timing)


def test_slo_scales_with_generated_tokens(seeded_clickhouse: SeededClickHouse) -> None:
    """Each request is judged by its own SLO: base + tokens_out x per-token; an unnamed model gets the default."""
    s = seeded_clickhouse
    objectives = {"smollm": Objective(base_ms=100.0, per_new_token_ms=4.0)}
    rows = {r["model"]: r for r in run_report(s.client, time_from_ms=s.time_from_ms, time_to_ms=s.time_to_ms,
                                              names=(), objectives=objectives).sections["slo"]}  # fmt: skip
    for model, (base, per_token) in {"smollm": (100.0, 4.0), "minilm": (1000.0, 0.0)}.items():
        e2e = _column(s, "latency", model, "e2e_ms")
        ok = _column(s, "latency", model, "outcome") == "ok"
        slo = base + _column(s, "latency", model, "tokens_out") * per_token
        row = rows[model]
        assert (row["slo_p99_ms"], row["slo_ms_per_new_token"]) == (base, per_token)
        assert row["within_slo_share"] == pytest.approx(np.mean(ok & (e2e <= slo)), rel=1e-12)
        assert row["p99_over_slo"] == pytest.approx(np.quantile(np.where(ok, e2e / slo, np.inf), 0.99), rel=1e-12)
    flat = run_report(s.client, time_from_ms=s.time_from_ms, time_to_ms=s.time_to_ms, names=(),
                      objectives={"smollm": Objective(base_ms=100.0)}).sections["slo"]  # fmt: skip
    flat_smollm = next(r for r in flat if r["model"] == "smollm")
    assert flat_smollm["within_slo_share"] < rows["smollm"]["within_slo_share"], "per-token allowance admits more"


def test_batch_figures_match_numpy(seeded_clickhouse: SeededClickHouse, report: Report) -> None:
    s = seeded_clickhouse
    loads_seen: set[str] = set()
    for model in s.summary.models:
        size = _column(s, "batches", model, "size")
        sizes = {r["size"]: r["batches"] for r in report.sections["batch_sizes"] if r["model"] == model}
        assert sizes == {int(k): int(v) for k, v in zip(*np.unique(size, return_counts=True), strict=True)}
        reasons = {r["reason"]: r["batches"] for r in report.sections["dispatch_reasons"] if r["model"] == model}
        assert reasons == Counter(_column(s, "batches", model, "reason").tolist())
        rate, compute = _column(s, "batches", model, "arrival_rate_per_s"), _column(s, "batches", model, "compute_ms")
        window, target = _column(s, "batches", model, "window_ms"), _column(s, "batches", model, "target_size")
        busy = rate * (compute + window) / 1000 >= target
        hit = _column(s, "batches", model, "hit_target")
        hits = {r["load"]: r for r in report.sections["target_hit_ratio"] if r["model"] == model}
        expected = {load: mask for load, mask in (("busy", busy), ("idle", ~busy)) if mask.any()}
        assert hits.keys() == expected.keys()
        for load, mask in expected.items():
            assert hits[load]["batches"] == mask.sum()
            assert hits[load]["hit_ratio"] == pytest.approx(hit[mask].mean(), rel=1e-12)
        loads_seen.update(hits)
        mem = _column(s, "batches", model, "device_mem_bytes")
        (memory,) = [r for r in report.sections["device_memory"] if r["model"] == model]
        assert memory["mem_p50_bytes"] == pytest.approx(np.quantile(mem, 0.5), rel=1e-12)
        assert memory["mem_max_bytes"] == mem.max()
        by_size = {r["size"]: r for r in report.sections["compute_by_batch_size"] if r["model"] == model}
        for b, row in by_size.items():
            assert row["compute_p50_ms"] == pytest.approx(np.quantile(compute[size == b], 0.5), rel=1e-12)
    assert loads_seen == {"busy", "idle"}, "the seeded load swings between busy and idle"


def test_rollups_agree_with_raw_rows(seeded_clickhouse: SeededClickHouse) -> None:
    s = seeded_clickhouse
    common: dict[str, Any] = {
        "time_from_ms": s.time_from_ms,
        "time_to_ms": s.time_to_ms,
        "interval_ms": 300_000,
        "model": None,
    }
    raw = {(r["time"], r["model"]): r for r in run_query(s.client, "latency_quantiles", **common)}
    rolled = {(r["time"], r["model"]): r for r in run_query(s.client, "latency_quantiles_rollup", **common)}
    assert rolled.keys() == raw.keys()
    timing = {
        (t, model): q
        for t, model, q in s.client.query(
            "SELECT toStartOfInterval(toDateTime(enqueue_time), INTERVAL 300 second) AS t, model, "
            "quantilesTiming(0.5, 0.99, 0.999)(e2e_ms) FROM request_latency FINAL GROUP BY t, model"
        ).result_rows
    }
    for key, row in rolled.items():
        assert row["requests"] == raw[key]["requests"], "rollup counts are exact"
        assert [row["e2e_p50_ms"], row["e2e_p99_ms"], row["e2e_p999_ms"]] == timing[key], (
            "merged per-minute states equal the same estimator over the raw rows"
        )
        assert row["e2e_p50_ms"] == pytest.approx(raw[key]["e2e_p50_ms"], abs=2.0), "1 ms resolution below 1 s"
    sizes = {(r["model"], r["size"]): r["batches"] for r in run_query(s.client, "batch_sizes", **common)}
    rolled_sizes = {
        (r["model"], r["size"]): r["batch_count"] for r in run_query(s.client, "batch_sizes_rollup", **common)
    }
    assert rolled_sizes == sizes


def test_model_filter_is_bound_and_injection_finds_nothing(seeded_clickhouse: SeededClickHouse) -> None:
    s = seeded_clickhouse
    before = s.client.command("SELECT count() FROM request_latency")
    one = run_report(s.client, time_from_ms=s.time_from_ms, time_to_ms=s.time_to_ms, model="smollm")
    assert [r["model"] for r in one.sections["summary"]] == ["smollm"]
    for hostile in ("smollm' OR '1'='1", "x') OR 1=1 --", "x'); DROP TABLE request_latency; --", "{model:String}"):
        attempt = run_report(s.client, time_from_ms=s.time_from_ms, time_to_ms=s.time_to_ms, model=hostile)
        assert all(rows == [] for rows in attempt.sections.values()), hostile
    assert s.client.command("SELECT count() FROM request_latency") == before


def test_cli_json(seeded_clickhouse: SeededClickHouse, tmp_path: Path) -> None:
    import typer

    from pipeline.tools.commands import db

    s = seeded_clickhouse
    config = tmp_path / "batchtide.toml"
    config.write_text(f'[clickhouse]\ndata_dir = "{s.settings.data_dir}"\ndatabase = "{s.database}"\n')
    app = typer.Typer()
    db.register(app)
    result = CliRunner().invoke(
        app, ["report", "--config", str(config), "--since", "2h", "--model", "minilm", "--json"]
    )
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    (summary,) = body["sections"]["summary"]
    wait = _column(s, "latency", "minilm", "wait_ms")
    assert summary["requests"] == len(wait)
    assert summary["wait_p99_ms"] == pytest.approx(np.quantile(wait, 0.99), rel=1e-12)
    assert body["sections"]["generation"] == [], "minilm does not generate"
    assert [r["slo_p99_ms"] for r in body["sections"]["slo"]] == [1000.0], "the config's default objective"
    assert body["model"] == "minilm" and body["interval_s"] == pick_interval_ms(2 * 3_600_000) / 1000
    text = CliRunner().invoke(app, ["report", "--config", str(config), "--since", "2h"])
    assert text.exit_code == 0 and "smollm" in text.output and "Dispatch reasons" in text.output
    assert "Generation" in text.output and "TTFT" in text.output and "SLO" in text.output


def test_durations_and_buckets() -> None:
    from pipeline.tools.views.report import parse_duration_ms

    assert parse_duration_ms("15m") == 900_000 and parse_duration_ms("1.5h") == 5_400_000
    assert parse_duration_ms("250ms") == 250
    for bad in ("15", "m", "-5m", "0s", "15 minutes", "1m; DROP"):
        with pytest.raises(ValueError):
            parse_duration_ms(bad)
    assert pick_interval_ms(15 * 60_000) == 120_000, "15 minutes -> 2-minute buckets (<= 12)"
    assert pick_interval_ms(3_600_000) == 300_000
    assert pick_interval_ms(10**12) == 86_400_000


def test_throughput_is_over_the_data_and_warmup_is_left_out(
    clickhouse_settings: ClickHouseSettings, ch_database: str
) -> None:
    """A 20 s run asked about over 3 h: req/s over the 20 s; warm-up requests (slow, as warm-ups are)
    are counted apart and move no latency figure."""
    start = recent_start_ms(60_000)
    chunk = next(iter(generate(400, seed=3, start_ms=start, duration_ms=20_000)))
    events = latency_events(chunk)
    warm = [msgspec.structs.replace(e, request_id=f"warm-{i}", e2e_ms=9_000.0, wait_ms=8_000.0, warmup=True)
            for i, e in enumerate(events[:5])]  # fmt: skip
    client = connect(clickhouse_settings, database=ch_database)
    try:
        insert_latency_events(client, ch_database, events + warm)
        now = start + 60_000
        report = run_report(client, time_from_ms=now - 3 * 3_600_000, time_to_ms=now, names=("summary", "warmup"))
    finally:
        client.close()
    for model, row in {r["model"]: r for r in report.sections["summary"]}.items():
        mine = [e for e in events if e.model == model]
        span_s = (max(e.produce_ms for e in mine) - min(e.enqueue_ms for e in mine)) / 1000
        assert row["requests"] == len(mine)
        assert row["span_s"] == pytest.approx(span_s) and span_s < 25
        assert row["requests_per_s"] == pytest.approx(len(mine) / span_s)
        assert row["e2e_p999_ms"] == pytest.approx(np.quantile([e.e2e_ms for e in mine], 0.999))
    warm_rows = {r["model"]: r["requests"] for r in report.sections["warmup"]}
    assert sum(warm_rows.values()) == len(warm) and all(r["e2e_max_ms"] == 9_000.0 for r in report.sections["warmup"])
