"""Alert rules as code: generated from the config, linted, kept fresh by `generate --check`, and
every rule's SQL evaluated on seeded rows in the real engine, where it must fire and where it must not."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from clickhouse_connect.driver.client import Client
from typer.testing import CliRunner

from dashboards import build
from dashboards.alerts import alert_rules, provisioning
from dashboards.lint import lint_alert_rules
from pipeline.core.config import ClickHouseSettings, load_config, parse_config
from pipeline.core.store.connection import connect
from pipeline.core.store.group_lag import GroupSample
from pipeline.core.store.lag_writer import insert_group_samples
from pipeline.core.store.macros import expand_macros
from pipeline.core.store.writer import insert_batch_events, insert_latency_events
from schemas.messages import BatchEvent, LatencyEvent, Outcome, PartitionLag
from tests.dashboards.cli import dashboards_cli

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "dashboards" / "provisioning" / "alerting" / "batchtide.yaml"
CONFIG = parse_config(
    {
        "models": {
            "slow": {"runner": "cost-model", "slo_p99_ms": 1000.0},
            "fine": {"runner": "cost-model", "slo_p99_ms": 1000.0},
        },
        "alerts": {"slo_minutes": 5, "dlq_per_s": 1.0, "lag_age_s": 60.0, "stalled_minutes": 3, "no_member_s": 60.0},
    }
)
NOW = int(time.time() * 1000)


def _rule(document: dict[str, Any], uid: str) -> dict[str, Any]:
    (group,) = document["groups"]
    (rule,) = [r for r in group["rules"] if r["uid"] == uid]
    return rule


def evaluate(client: Client, rule: dict[str, Any], now_ms: int = NOW) -> dict[str, bool]:
    """Run the rule as Grafana does: query A over its relative range, threshold C on each model's value."""
    query = next(d for d in rule["data"] if d["refId"] == "A")
    condition = next(d for d in rule["data"] if d["refId"] == rule["condition"])["model"]
    assert condition["type"] == "threshold" and condition["expression"] == "A"
    (evaluator,) = [c["evaluator"] for c in condition["conditions"]]
    assert evaluator["type"] == "gt"
    window_ms = query["relativeTimeRange"]["from"] * 1000
    sql = expand_macros(
        query["model"]["rawSql"], time_from_ms=now_ms - window_ms, time_to_ms=now_ms, interval_ms=60_000
    )
    rows = client.query(sql).named_results()
    return {str(r["model"]): float(r["value"]) > float(evaluator["params"][0]) for r in rows}


@pytest.fixture
def store(clickhouse_settings: ClickHouseSettings, ch_database: str) -> Iterator[Client]:
    client = connect(dataclasses.replace(clickhouse_settings, database=ch_database), database=ch_database)
    yield client
    client.close()


def _latency(
    model: str, enqueue_ms: int, e2e_ms: float, n: int, outcome: Outcome = "ok", reason: str = ""
) -> LatencyEvent:
    return LatencyEvent(
        request_id=f"{model}-{enqueue_ms}-{n}", model=model, consumer_id="c", outcome=outcome, reason=reason,
        enqueue_ms=enqueue_ms, fetch_ms=enqueue_ms, dispatch_ms=enqueue_ms, compute_start_ms=enqueue_ms,
        compute_end_ms=enqueue_ms + int(e2e_ms), produce_ms=enqueue_ms + int(e2e_ms), wait_ms=0.0,
        compute_ms=e2e_ms, e2e_ms=e2e_ms, batch_id=1, batch_size=1, tail_marked=False, priority=1,
        tokens_in=1, tokens_out=0, device_mem_bytes=0, device_mem_kind="none", partition=0, offset=n,
    )  # fmt: skip


def _group(model: str, ts_ms: int, lags: dict[int, int], *, members: int = 1, age_ms: float = 0.0) -> GroupSample:
    """A broker-side sample of `model`'s group, as the sink's sampler writes it."""
    parts = [
        PartitionLag(f"p.requests.{model}", p, 100 + lag, 100, lag, int(ts_ms - age_ms) if lag else 0,
                     age_ms if lag else 0.0)
        for p, lag in sorted(lags.items())
    ]  # fmt: skip
    return GroupSample(ts_ms, model, members, parts)


def _dead_letter_topic(ts_ms: int, ends: dict[int, int]) -> GroupSample:
    return GroupSample(ts_ms, "", 0, [PartitionLag("p.dlq", p, end, -1, 0, 0, 0.0) for p, end in sorted(ends.items())])


def _batch(model: str, dispatch_ms: int, batch_id: int) -> BatchEvent:
    return BatchEvent(
        batch_id=batch_id, model=model, consumer_id="c", dispatch_ms=dispatch_ms, size=1, cost=1, reason="idle",
        window_ms=0.0, hit_target=False, target_size=32, marked_count=0, oldest_wait_ms=0.0, queue_depth=1,
        effective_cap=32, cap_reason="hard_cap", arrival_rate_per_s=1.0, compute_ms=1.0, tokens_in=1, tokens_out=0,
        device_mem_bytes=0, device_mem_kind="none",
    )  # fmt: skip


def test_committed_rules_are_generated_from_the_repository_config_and_pass_lint() -> None:
    document = yaml.safe_load(COMMITTED.read_text())
    assert lint_alert_rules(document) == []
    assert document == provisioning(load_config(ROOT / "batchtide.toml"))
    titles = [r["title"] for r in document["groups"][0]["rules"]]
    assert titles[0].startswith("minilm: p99 above its SLO")


def test_rules_follow_the_config() -> None:
    config = parse_config({
        "models": {"a": {"runner": "cost-model", "slo_p99_ms": 250.0}, "b": {"runner": "cost-model"}},
        "alerts": {"lag_age_s": 15.0, "dlq_per_s": 0.5, "stalled_minutes": 7, "slo_minutes": 3, "no_member_s": 30.0},
    })  # fmt: skip
    rules = {r.uid: r for r in alert_rules(config)}
    assert rules["batchtide-slo-a"].threshold == 250.0 and rules["batchtide-slo-b"].threshold == 1000.0
    assert rules["batchtide-slo-a"].window_s == 180 and "HAVING count() >= 3" in rules["batchtide-slo-a"].sql
    assert rules["batchtide-lag-age"].threshold == 15.0 and rules["batchtide-dlq-rate"].threshold == 0.5
    assert rules["batchtide-stalled"].window_s == 420 and rules["batchtide-no-consumer"].window_s == 30
    with pytest.raises(ValueError, match="spliced"):
        alert_rules(dataclasses.replace(config, models={"x'; DROP": config.models["a"]}))


def test_lint_names_the_broken_parts() -> None:
    document = provisioning(CONFIG)
    broken = copy.deepcopy(document)
    rules = broken["groups"][0]["rules"]
    rules[0]["condition"] = "Z"
    rules[1]["data"][0]["model"]["rawSql"] = "SELECT model, 1 AS value FROM batches WHERE model = ${model:sqlstring}"
    rules[2]["uid"] = rules[3]["uid"]
    del rules[3]["annotations"]["summary"]
    problems = "\n".join(lint_alert_rules(broken))
    for expected in ("condition 'Z' names no query", "no $__timeFilter", "uses $model", "duplicate uid", "no summary"):
        assert expected in problems


def test_generate_check_covers_the_alert_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "DASHBOARDS_DIR", tmp_path)
    config = tmp_path / "mine.toml"
    config.write_text('[models.alpha]\nrunner = "cost-model"\nslo_p99_ms = 321\n\n[alerts]\nlag_age_s = 42\n')
    runner = CliRunner()
    written = runner.invoke(dashboards_cli(), ["dashboards", "generate", "--config", str(config)])
    assert written.exit_code == 0, written.output
    alerting = tmp_path / "provisioning" / "alerting" / "batchtide.yaml"
    document = yaml.safe_load(alerting.read_text())
    assert _rule(document, "batchtide-slo-alpha")["data"][1]["model"]["conditions"][0]["evaluator"]["params"] == [321.0]
    assert (
        runner.invoke(dashboards_cli(), ["dashboards", "generate", "--check", "--config", str(config)]).exit_code == 0
    )
    alerting.write_text(alerting.read_text().replace("- 42.0", "- 43.0"))
    stale = runner.invoke(dashboards_cli(), ["dashboards", "generate", "--check", "--config", str(config)])
    assert stale.exit_code == 1 and "alerting/batchtide.yaml" in stale.output


def test_slo_rule_fires_only_when_every_minute_is_over(store: Client, ch_database: str) -> None:
    events, n = [], 0
    dip = (NOW - 150_000) // 60_000
    for t in range(NOW - 295_000, NOW, 5_000):
        n += 1
        events.append(_latency("slow", t, 1500.0, n))
        events.append(_latency("fine", t, 200.0 if t // 60_000 == dip else 1500.0, n))
    insert_latency_events(store, ch_database, events)
    document = provisioning(CONFIG)
    assert evaluate(store, _rule(document, "batchtide-slo-slow")) == {"slow": True}
    assert evaluate(store, _rule(document, "batchtide-slo-fine")) == {"fine": False}


def test_slo_rule_counts_refusals_as_misses(store: Client, ch_database: str) -> None:
    events, n = [], 0
    now = NOW // 60_000 * 60_000  # five whole minutes, so every bucket holds 60 requests
    for t in range(now - 300_000, now, 1_000):
        n += 1
        # both models answer fast; 'fine' also refuses 1 request in 20 (5%, more than the 1% a p99 allows)
        events.append(_latency("slow", t, 100.0, n))
        events.append(_latency("fine", t, 100.0, n, *(("rejected", "too_long") if n % 20 == 0 else ("ok", ""))))
    insert_latency_events(store, ch_database, events)
    document = provisioning(CONFIG)
    assert evaluate(store, _rule(document, "batchtide-slo-fine"), now) == {"fine": True}, "refusals miss the SLO"
    assert evaluate(store, _rule(document, "batchtide-slo-slow"), now) == {"slow": False}


def test_dlq_lag_age_and_stall_rules_fire_where_they_must(store: Client, ch_database: str) -> None:
    samples, batches = [], []
    for i, t in enumerate(range(NOW - 290_000, NOW, 5_000)):
        last = t + 5_000 >= NOW
        # slow: the oldest record 90 s old at the last sample, lag never drains, members but no batch
        samples.append(_group("slow", t, {0: 30 + i}, age_ms=90_000.0 if last else 1_000.0))
        # fine: a 120 s age earlier but 5 s now, same waiting lag, but batches run
        samples.append(_group("fine", t, {0: 30 + i}, age_ms=5_000.0 if last else 120_000.0))
        batches.append(_batch("fine", t, i))
    insert_group_samples(store, ch_database, samples)
    insert_batch_events(store, ch_database, batches)
    document = provisioning(CONFIG)
    assert evaluate(store, _rule(document, "batchtide-lag-age")) == {"slow": True, "fine": False}
    assert evaluate(store, _rule(document, "batchtide-stalled")) == {"slow": True, "fine": False}


def test_dlq_rule_reads_the_dead_letter_topics_end_offsets(store: Client, ch_database: str) -> None:
    rule = _rule(provisioning(CONFIG), "batchtide-dlq-rate")
    # 0.8 letters/s on two partitions together over the 5-minute window: under the 1/s threshold
    insert_group_samples(store, ch_database, [
        _dead_letter_topic(t, {0: 1000 + 2 * i, 1: 50 + 2 * i}) for i, t in enumerate(range(NOW - 295_000, NOW, 5_000))
    ])  # fmt: skip
    assert evaluate(store, rule) == {"all models": False}
    # then a burst: 600 more letters on partition 1 within the window, 2.8/s in all
    insert_group_samples(store, ch_database, [_dead_letter_topic(NOW - 1_000, {0: 1118, 1: 766})])
    assert evaluate(store, rule) == {"all models": True}


def test_no_consumer_rule_fires_only_after_a_minute_without_members_while_records_wait(
    store: Client, ch_database: str
) -> None:
    samples = []
    for t in range(NOW - 120_000, NOW, 5_000):
        gone = t >= NOW - 65_000
        samples.append(_group("orphan", t, {0: 40, 1: 2}, members=0 if gone else 2))  # nobody for 65 s, records wait
        samples.append(_group("idle", t, {0: 0}, members=0))  # nobody, but nothing waits: scaled to zero
        samples.append(_group("served", t, {0: 40}, members=1))  # records wait, a member serves them
        samples.append(_group("just-left", t, {0: 40}, members=0 if t >= NOW - 20_000 else 1))
    insert_group_samples(store, ch_database, samples)
    fired = evaluate(store, _rule(provisioning(CONFIG), "batchtide-no-consumer"))
    assert fired == {"orphan": True, "idle": False, "served": False, "just-left": False}


def test_stall_rule_stays_quiet_when_records_drain_or_samples_are_too_short(store: Client, ch_database: str) -> None:
    samples = []
    for i, t in enumerate(range(NOW - 170_000, NOW, 5_000)):
        samples.append(_group("drained", t, {0: 0 if i == 10 else 5}))
    for t in range(NOW - 30_000, NOW, 5_000):
        samples.append(_group("new", t, {0: 5}))
    for t in range(NOW - 170_000, NOW, 5_000):
        samples.append(_group("memberless", t, {0: 5}, members=0))
    insert_group_samples(store, ch_database, samples)
    fired = evaluate(store, _rule(provisioning(CONFIG), "batchtide-stalled"))
    assert fired.get("drained") is False, "the partition drained once: records did not wait the whole window"
    assert "new" not in fired, "30 s of samples cannot show a 3-minute stall"
    assert "memberless" not in fired, "no member is the no-consumer rule's page, not a stall"
