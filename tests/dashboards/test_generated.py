"""The committed Grafana JSON is what the generator makes, and the linter catches broken boards."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

import dashboards.build as build
from dashboards.lint import lint_dashboard
from dashboards.panels import (
    BOARDS,
    DATASOURCE_TYPE,
    DATASOURCE_UID,
    FOLDER_UID,
    MODEL_VARIABLE,
    MODELS_QUERY,
    TAIL_LATENCY,
)
from dashboards.sql import query_sql
from tests.dashboards.cli import dashboards_cli

ROOT = Path(__file__).resolve().parents[2]
PROVISIONING = ROOT / "dashboards" / "provisioning"


@pytest.fixture(scope="module")
def board() -> dict[str, Any]:
    return build.build_board(TAIL_LATENCY)


def test_committed_json_is_up_to_date() -> None:
    generated = build.generated_files()
    assert generated, "generated_files() is empty: nothing would be checked"
    for path, text in generated.items():
        assert path.exists(), f"{path} missing: run `batchtide dashboards generate`"
        assert path.read_text() == text, f"{path} is stale: run `batchtide dashboards generate`"


def test_generated_board_is_lint_clean(board: dict[str, Any]) -> None:
    assert lint_dashboard(board) == []


def test_board_has_the_field_report_panels_on_one_screen(board: dict[str, Any]) -> None:
    titles = {p["title"] for p in board["panels"]}
    for required in (
        "p99 / p999 over time",
        "Batch size distribution",
        "Queue wait distribution",
        "Device memory",
        "Throughput",
        "Target hit ratio, busy vs idle",
        "Requests waiting > 1 s",
        "Tail-marked share",
        "Marked vs unmarked p99 wait",
        "Batching window vs arrival rate",
        "Dispatch reasons",
        "Per-batch compute time by batch size",
    ):
        assert required in titles
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"])
    assert bottom <= 30, "the board must fit one screen (~30 grid rows)"


def test_panels_run_the_shared_report_sql_verbatim(board: dict[str, Any]) -> None:
    by_title = {p["title"]: p for p in board["panels"]}
    for spec in TAIL_LATENCY.panels:
        target = by_title[spec.title]["targets"][0]
        assert target["rawSql"] == query_sql(spec.query)
        assert target["format"] == spec.format_code
        assert target["editorType"] == "sql"
        assert target["datasource"] == {"type": DATASOURCE_TYPE, "uid": DATASOURCE_UID}
    (variable,) = board["templating"]["list"]
    assert variable["name"] == MODEL_VARIABLE
    assert variable["type"] == "query"
    assert variable["query"] == query_sql(MODELS_QUERY)
    assert variable["datasource"]["uid"] == DATASOURCE_UID


def _wrong_type(b: dict) -> None:
    b["panels"][2]["datasource"]["type"] = "clickhouse"


def _wrong_target_uid(b: dict) -> None:
    b["panels"][1]["targets"][0]["datasource"]["uid"] = "some-other-uid"


def _duplicate_ref_id(b: dict) -> None:
    b["panels"][0]["targets"].append(copy.deepcopy(b["panels"][0]["targets"][0]))


def _overlap(b: dict) -> None:
    b["panels"][3]["gridPos"] = dict(b["panels"][0]["gridPos"], x=4, y=2)


def _missing_unit(b: dict) -> None:
    del b["panels"][4]["fieldConfig"]["defaults"]["unit"]


def _off_grid(b: dict) -> None:
    b["panels"][5]["gridPos"]["x"] = 20


def _no_time_filter(b: dict) -> None:
    b["panels"][6]["targets"][0]["rawSql"] = "SELECT 1 WHERE model = '${model}'"


def _variable_wrong_ds(b: dict) -> None:
    b["templating"]["list"][0]["datasource"]["type"] = "prometheus"


def _table_format_on_timeseries(b: dict) -> None:
    panel = next(p for p in b["panels"] if p["type"] == "timeseries")
    panel["targets"][0]["format"] = 1


BREAKAGES: list[tuple[Callable[[dict], None], str]] = [
    (_wrong_type, "datasource type 'clickhouse'"),
    (_wrong_target_uid, "datasource uid 'some-other-uid'"),
    (_duplicate_ref_id, "duplicate refId 'A'"),
    (_overlap, "overlaps panel"),
    (_missing_unit, "no unit"),
    (_off_grid, "outside the 24-column grid"),
    (_no_time_filter, "ignores the dashboard time range"),
    (_variable_wrong_ds, "variable 'model': datasource type 'prometheus'"),
    (_table_format_on_timeseries, "needs format 0"),
]


@pytest.mark.parametrize("breakage,message", BREAKAGES, ids=[b.__name__.strip("_") for b, _ in BREAKAGES])
def test_linter_fails_on_broken_copies(board: dict[str, Any], breakage: Callable[[dict], None], message: str) -> None:
    broken = copy.deepcopy(board)
    breakage(broken)
    problems = lint_dashboard(broken)
    assert any(message in p for p in problems), problems


def test_generate_refuses_a_board_that_fails_lint(monkeypatch: pytest.MonkeyPatch) -> None:
    original = build.build_board

    def broken_build(spec: Any) -> dict[str, Any]:
        model = original(spec)
        _missing_unit(model)
        return model

    monkeypatch.setattr(build, "build_board", broken_build)
    with pytest.raises(build.DashboardLintError, match="no unit"):
        build.generated_files()


def test_generate_and_check_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "DASHBOARDS_DIR", tmp_path)
    runner = CliRunner()
    stale = runner.invoke(dashboards_cli(), ["dashboards", "generate", "--check"])
    assert stale.exit_code == 1 and "stale" in stale.output
    written = runner.invoke(dashboards_cli(), ["dashboards", "generate"])
    assert written.exit_code == 0, written.output
    assert sorted(p.name for p in tmp_path.glob("*.json")) == sorted(f"{b.uid}.json" for b in BOARDS)
    assert (tmp_path / "provisioning" / "alerting" / "batchtide.yaml").is_file()
    assert runner.invoke(dashboards_cli(), ["dashboards", "generate", "--check"]).exit_code == 0
    path = tmp_path / f"{TAIL_LATENCY.uid}.json"
    edited = json.loads(path.read_text())
    edited["title"] = "hand edited"
    path.write_text(json.dumps(edited))
    assert runner.invoke(dashboards_cli(), ["dashboards", "generate", "--check"]).exit_code == 1


def test_provisioned_datasource_matches_the_panels() -> None:
    config = yaml.safe_load((PROVISIONING / "datasources" / "clickhouse.yaml").read_text())
    (datasource,) = config["datasources"]
    assert datasource["uid"] == DATASOURCE_UID
    assert datasource["type"] == DATASOURCE_TYPE
    json_data = datasource["jsonData"]
    for key, env in (
        ("host", "$BATCHTIDE_CLICKHOUSE_HOST"),
        ("port", "$BATCHTIDE_CLICKHOUSE_PORT"),
        ("protocol", "$BATCHTIDE_CLICKHOUSE_PROTOCOL"),
        ("username", "$BATCHTIDE_CLICKHOUSE_READ_USER"),  # a read-only user, not the sink's
    ):
        assert json_data[key] == env
    assert datasource["secureJsonData"] == {"password": "$BATCHTIDE_CLICKHOUSE_READ_PASSWORD"}
    assert "password" not in json.dumps(json_data)


def test_dashboard_provider_points_at_the_generated_json() -> None:
    config = yaml.safe_load((PROVISIONING / "dashboards" / "batchtide.yaml").read_text())
    (provider,) = config["providers"]
    assert provider["type"] == "file"
    assert provider["folderUid"] == FOLDER_UID
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_docker_compose_mounts_and_env_match_the_provisioning() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    grafana = compose["services"]["grafana"]
    mounts = {m.split(":")[0]: m.split(":")[1] for m in grafana["volumes"]}
    assert mounts["./dashboards/provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./dashboards"] == "/var/lib/grafana/dashboards"
    assert "grafana-clickhouse-datasource" in grafana["environment"]["GF_INSTALL_PLUGINS"]
    text = (PROVISIONING / "datasources" / "clickhouse.yaml").read_text()
    needed = set(re.findall(r"\$(BATCHTIDE_[A-Z_]+)", text))
    assert needed <= set(grafana["environment"]), needed - set(grafana["environment"])
