"""`dashboards push` over real HTTP (grafana-client) against a recording Grafana API."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from dashboards.alerts import GROUP_NAME, alert_rules
from dashboards.build import default_config_path
from dashboards.panels import BOARDS, DATASOURCE_TYPE, DATASOURCE_UID, FOLDER_UID, TAIL_LATENCY
from pipeline.core.config import load_config, parse_config
from pipeline.tools.views.grafana_push import (
    ClickHouseTarget,
    GrafanaAuthMissing,
    connect,
    grafana_credential,
    push_all,
)
from tests.dashboards.cli import dashboards_cli
from tests.dashboards.grafana_server import FakeGrafana

BOARD_FILE = Path(__file__).resolve().parents[2] / "dashboards" / f"{TAIL_LATENCY.uid}.json"
TOKEN = "glsa_test_token_value"
CH_PASSWORD = "ch-secret-value"

FIRST_PUSH = [
    ("GET", f"/api/datasources/uid/{DATASOURCE_UID}"),
    ("POST", "/api/datasources"),
    ("GET", f"/api/folders/{FOLDER_UID}"),
    ("POST", "/api/folders"),
    ("GET", f"/api/dashboards/uid/{TAIL_LATENCY.uid}"),
    ("POST", "/api/dashboards/db"),
]
READS_ONLY = [
    ("GET", f"/api/datasources/uid/{DATASOURCE_UID}"),
    ("GET", f"/api/folders/{FOLDER_UID}"),
    ("GET", f"/api/dashboards/uid/{TAIL_LATENCY.uid}"),
]


@pytest.fixture
def grafana() -> Iterator[FakeGrafana]:
    with FakeGrafana() as server:
        yield server


@pytest.fixture
def board() -> dict:
    return json.loads(BOARD_FILE.read_text())


@pytest.fixture
def target(monkeypatch: pytest.MonkeyPatch) -> ClickHouseTarget:
    monkeypatch.setenv("BATCHTIDE_CLICKHOUSE_USER", "grafana_ro")
    monkeypatch.setenv("BATCHTIDE_CLICKHOUSE_PASSWORD", CH_PASSWORD)
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    return ClickHouseTarget.from_url("http://clickhouse:8123", "batchtide")


def test_first_push_creates_everything_then_second_push_writes_nothing(
    grafana: FakeGrafana, board: dict, target: ClickHouseTarget
) -> None:
    api = connect(grafana.url)
    first = push_all(api, target, [board])
    assert [r.outcome for r in first] == ["created", "created", "created"]
    assert grafana.calls() == FIRST_PUSH

    stored_ds = grafana.state.datasources[DATASOURCE_UID]
    assert stored_ds["type"] == DATASOURCE_TYPE
    assert stored_ds["jsonData"]["host"] == "clickhouse"
    assert stored_ds["jsonData"]["port"] == 8123
    assert stored_ds["jsonData"]["protocol"] == "http"
    assert stored_ds["jsonData"]["username"] == "grafana_ro"
    assert stored_ds["secureJsonData"] == {"password": CH_PASSWORD}
    assert grafana.state.dashboards[TAIL_LATENCY.uid]["meta"]["folderUid"] == FOLDER_UID
    assert grafana.state.dashboards[TAIL_LATENCY.uid]["dashboard"]["panels"] == board["panels"]
    assert all(r.authorization == f"Bearer {TOKEN}" for r in grafana.state.requests)

    grafana.clear()
    second = push_all(connect(grafana.url), target, [board])
    assert [r.outcome for r in second] == ["unchanged", "unchanged", "unchanged"]
    assert grafana.calls() == READS_ONLY
    assert grafana.writes() == []
    assert grafana.state.dashboards[TAIL_LATENCY.uid]["dashboard"]["version"] == 1


def test_changed_objects_are_updated_and_only_those(
    grafana: FakeGrafana, board: dict, target: ClickHouseTarget
) -> None:
    push_all(connect(grafana.url), target, [board])
    grafana.clear()

    changed = json.loads(json.dumps(board))
    changed["panels"][0]["title"] = "p99 / p999 (edited)"
    moved = ClickHouseTarget.from_url("http://clickhouse-2:8123", "batchtide")
    results = push_all(connect(grafana.url), moved, [changed])

    assert [r.outcome for r in results] == ["updated", "unchanged", "updated"]
    assert grafana.writes() == [
        ("PUT", f"/api/datasources/uid/{DATASOURCE_UID}"),
        ("POST", "/api/dashboards/db"),
    ]
    grafana.state.folders[FOLDER_UID]["title"] = "renamed in the UI"
    grafana.clear()
    results = push_all(connect(grafana.url), moved, [changed])
    assert [r.outcome for r in results] == ["unchanged", "updated", "unchanged"]
    assert grafana.writes() == [("PUT", f"/api/folders/{FOLDER_UID}")]
    assert grafana.state.folders[FOLDER_UID]["title"] == "batchtide"
    stored = grafana.state.dashboards[TAIL_LATENCY.uid]["dashboard"]
    assert stored["version"] == 2
    assert stored["panels"][0]["title"] == "p99 / p999 (edited)"
    assert grafana.state.datasources[DATASOURCE_UID]["jsonData"]["host"] == "clickhouse-2"
    assert grafana.state.datasources[DATASOURCE_UID]["secureJsonData"] == {"password": CH_PASSWORD}


def test_basic_auth_is_used_when_no_token(
    grafana: FakeGrafana, board: dict, target: ClickHouseTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GRAFANA_TOKEN")
    monkeypatch.setenv("GRAFANA_USER", "admin")
    monkeypatch.setenv("GRAFANA_PASSWORD", "pw")
    push_all(connect(grafana.url), target, [board])
    expected = "Basic " + base64.b64encode(b"admin:pw").decode()
    assert {r.authorization for r in grafana.state.requests} == {expected}


def test_missing_credentials_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GRAFANA_TOKEN", "GRAFANA_USER", "GRAFANA_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(GrafanaAuthMissing):
        grafana_credential()


def test_cli_push_reports_outcomes_and_never_prints_secrets(grafana: FakeGrafana, target: ClickHouseTarget) -> None:
    from typer.testing import CliRunner

    runner = CliRunner()
    args = ["dashboards", "push", "--grafana-url", grafana.url, "--clickhouse-url", "http://clickhouse:8123"]
    first = runner.invoke(dashboards_cli(), args)
    assert first.exit_code == 0, first.output
    assert "dashboard" in first.output and "created" in first.output
    second = runner.invoke(dashboards_cli(), args)
    assert second.exit_code == 0, second.output
    assert "created" not in second.output and "updated" not in second.output
    for output in (first.output, second.output):
        assert TOKEN not in output and CH_PASSWORD not in output
    rules = alert_rules(load_config(default_config_path()))
    assert len(grafana.state.alert_rules) == len(rules), "the repository config's rules, as `generate` writes them"
    # datasource and folder GET+POST, GET+POST per board and per rule, then the rule group's GET
    first_push = 4 + 2 * len(BOARDS) + 2 * len(rules) + 1
    methods = [m for m, _ in grafana.calls()[first_push:]]
    assert methods == ["GET"] * (2 + len(BOARDS) + len(rules) + 1), "the second push only reads"


def test_cli_push_without_clickhouse_server_explains(
    grafana: FakeGrafana, target: ClickHouseTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    monkeypatch.delenv("BATCHTIDE_CLICKHOUSE_URL", raising=False)
    result = CliRunner().invoke(dashboards_cli(), ["dashboards", "push", "--grafana-url", grafana.url])
    assert result.exit_code == 2
    assert "--clickhouse-url" in result.output
    assert grafana.calls() == []


RULES_CONFIG = {
    "models": {"a": {"runner": "cost-model", "slo_p99_ms": 300.0}, "b": {"runner": "cost-model"}},
    "alerts": {"lag_age_s": 30.0},
}


def test_alert_rules_go_through_the_provisioning_api_and_only_changes_are_written(
    grafana: FakeGrafana, board: dict, target: ClickHouseTarget
) -> None:
    rules = alert_rules(parse_config(RULES_CONFIG))
    first = push_all(connect(grafana.url), target, [board], rules)
    pushed = [r for r in first if r.kind == "alert-rule"]
    assert [(r.uid, r.outcome) for r in pushed] == [(rule.uid, "created") for rule in rules]
    assert ("rule-group", GROUP_NAME, "unchanged") in [(r.kind, r.uid, r.outcome) for r in first]
    assert grafana.writes()[3:] == [("POST", "/api/v1/provisioning/alert-rules")] * len(rules)
    for rule in rules:
        stored = grafana.state.alert_rules[rule.uid]
        assert {k: stored[k] for k in rule.to_provisioning()} == rule.to_provisioning(), "the file provisioning's rule"
        assert (stored["folderUID"], stored["ruleGroup"]) == (FOLDER_UID, GROUP_NAME)
    assert grafana.state.rule_groups == {(FOLDER_UID, GROUP_NAME): 60}

    grafana.clear()
    again = push_all(connect(grafana.url), target, [board], rules)
    assert {r.outcome for r in again} == {"unchanged"} and grafana.writes() == []

    # a threshold changed, a model removed, and the group's interval edited in Grafana
    changed = alert_rules(
        parse_config({**RULES_CONFIG, "models": {"a": {"runner": "cost-model", "slo_p99_ms": 250.0}}})
    )
    grafana.state.rule_groups[(FOLDER_UID, GROUP_NAME)] = 10
    grafana.clear()
    results = push_all(connect(grafana.url), target, [board], changed)
    outcomes = {(r.kind, r.uid): r.outcome for r in results}
    assert outcomes[("alert-rule", "batchtide-slo-a")] == "updated"
    assert outcomes[("alert-rule", "batchtide-slo-b")] == "deleted"
    assert outcomes[("rule-group", GROUP_NAME)] == "updated"
    assert grafana.writes() == [
        ("PUT", "/api/v1/provisioning/alert-rules/batchtide-slo-a"),
        ("DELETE", "/api/v1/provisioning/alert-rules/batchtide-slo-b"),
        ("PUT", f"/api/v1/provisioning/folder/{FOLDER_UID}/rule-groups/{GROUP_NAME}"),
    ]
    assert set(grafana.state.alert_rules) == {rule.uid for rule in changed}, "the group PUT kept every current rule"
    assert grafana.state.rule_groups[(FOLDER_UID, GROUP_NAME)] == 60
    threshold = grafana.state.alert_rules["batchtide-slo-a"]["data"][1]["model"]["conditions"][0]["evaluator"]
    assert threshold["params"] == [250.0]
