"""Grafana dashboard JSON generated from `dashboards/panels.py` with grafana-foundation-sdk,
and the alert rules provisioning file from `dashboards/alerts.py` and a config.

`python -m dashboards.build` (or `batchtide dashboards generate`) rewrites the
committed JSON; `--check` fails when it is stale. The output is deterministic
(sorted keys, fixed ids) so the committed file diffs cleanly.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import yaml

with warnings.catch_warnings():
    # The SDK warns at import that it prefers the v2 schema; see build_board for why we keep v1.
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from grafana_foundation_sdk.builders import barchart, dashboard, table, timeseries
    from grafana_foundation_sdk.builders import common as common_builders
    from grafana_foundation_sdk.cog import builder as cog_builder
    from grafana_foundation_sdk.cog import variants as cog_variants
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common as common_models
    from grafana_foundation_sdk.models import dashboard as dashboard_models

from dashboards.alerts import provisioning as alert_provisioning
from dashboards.lint import lint_alert_rules, lint_dashboard
from dashboards.panels import (
    BOARDS,
    DATASOURCE_TYPE,
    DATASOURCE_UID,
    MODEL_VARIABLE,
    MODELS_QUERY,
    BoardSpec,
    PanelSpec,
)
from dashboards.sql import query_sql
from pipeline.core.config import Config, load_config

DASHBOARDS_DIR = Path(__file__).resolve().parent
DATASOURCE = common_models.DataSourceRef(type_val=DATASOURCE_TYPE, uid=DATASOURCE_UID)


class ClickHouseQuery(cog_variants.Dataquery):
    """A target of the ClickHouse plugin in raw-SQL mode (the SDK has no ClickHouse type)."""

    def __init__(self, ref_id: str, raw_sql: str, format_code: int) -> None:
        self.ref_id = ref_id
        self.raw_sql = raw_sql
        self.format_code = format_code

    def to_json(self) -> dict[str, object]:
        return {
            "datasource": {"type": DATASOURCE_TYPE, "uid": DATASOURCE_UID},
            "editorType": "sql",
            "format": self.format_code,
            "queryType": "timeseries" if self.format_code == 0 else "table",
            "rawSql": self.raw_sql,
            "refId": self.ref_id,
        }


class ClickHouseQueryBuilder(cog_builder.Builder[ClickHouseQuery]):
    def __init__(self, query: ClickHouseQuery) -> None:
        self._query = query

    def build(self) -> ClickHouseQuery:
        return self._query


def _thresholds(spec: PanelSpec) -> dashboard.ThresholdsConfig:
    steps = [dashboard_models.Threshold(value=None, color=spec.base_color)]
    steps += [dashboard_models.Threshold(value=t.value, color=t.color) for t in spec.thresholds]
    return dashboard.ThresholdsConfig().mode(dashboard_models.ThresholdsMode.ABSOLUTE).steps(steps)


def _legend() -> common_builders.VizLegendOptions:
    return (
        common_builders.VizLegendOptions()
        .show_legend(True)
        .display_mode(common_models.LegendDisplayMode.LIST)
        .placement(common_models.LegendPlacement.BOTTOM)
    )


def _tooltip() -> common_builders.VizTooltipOptions:
    return (
        common_builders.VizTooltipOptions()
        .mode(common_models.TooltipDisplayMode.MULTI)
        .sort(common_models.SortOrder.DESCENDING)
    )


def _panel(spec: PanelSpec, panel_id: int) -> timeseries.Panel | barchart.Panel | table.Panel:
    target = ClickHouseQueryBuilder(ClickHouseQuery("A", query_sql(spec.query), spec.format_code))
    if spec.kind == "timeseries":
        panel: Any = (
            timeseries.Panel()
            .line_width(2)
            .fill_opacity(8)
            .show_points(common_models.VisibilityMode.NEVER)
            .span_nulls(False)
        )
        if spec.thresholds:
            panel = panel.thresholds_style(
                common_builders.GraphThresholdsStyleConfig().mode(common_models.GraphThresholdsStyleMode.DASHED)
            )
    elif spec.kind == "table":
        panel = table.Panel().show_header(True).cell_height(common_models.TableCellHeight.SM)
    else:
        panel = (
            barchart.Panel()
            .show_value(common_models.VisibilityMode.AUTO)
            .stacking(common_models.StackingMode.NORMAL if spec.stacked else common_models.StackingMode.NONE)
            .fill_opacity(80)
            .x_tick_label_rotation(0)
        )
        if spec.x_field:
            # Numbers on a bar chart's x axis are labels, not a scale: make them strings.
            panel = panel.x_field(spec.x_field).with_transformation(
                dashboard_models.DataTransformerConfig(
                    id_val="convertFieldType",
                    options={"conversions": [{"targetField": spec.x_field, "destinationType": "string"}], "fields": {}},
                )
            )
    panel = (
        panel.id(panel_id)
        .title(spec.title)
        .description(spec.description)
        .datasource(DATASOURCE)
        .with_target(target)
        .unit(spec.unit)
        .min(0)
        .thresholds(_thresholds(spec))
        .grid_pos(dashboard_models.GridPos(h=spec.h, w=spec.w, x=spec.x, y=spec.y))
    )
    if spec.kind != "table":
        panel = panel.legend(_legend()).tooltip(_tooltip())
    if spec.max_value is not None:
        panel = panel.max(spec.max_value)
    for column, unit in sorted(spec.field_units.items()):
        placement = [] if spec.kind == "table" else [
            dashboard_models.DynamicConfigValue(id_val="custom.axisPlacement", value="right")
        ]  # fmt: skip
        panel = panel.override_by_regexp(
            column_pattern((column,)), [dashboard_models.DynamicConfigValue(id_val="unit", value=unit), *placement]
        )
    if spec.hidden:
        hide = (
            dashboard_models.DynamicConfigValue(id_val="custom.hidden", value=True)
            if spec.kind == "table"
            else dashboard_models.DynamicConfigValue(
                id_val="custom.hideFrom", value={"legend": True, "tooltip": True, "viz": True}
            )
        )
        panel = panel.override_by_regexp(column_pattern(spec.hidden), [hide])
    built: timeseries.Panel | barchart.Panel | table.Panel = panel  # the builders' chain is typed Any
    return built


def column_pattern(columns: tuple[str, ...]) -> str:
    """Matches a query column by display name, with or without the plugin's label suffix
    (long-format results become `e2e_p99_ms minilm` or `e2e_p99_ms {model="minilm"}`)."""
    return "^(" + "|".join(columns) + ")( .*)?$"


def _model_variable() -> dashboard.QueryVariable:
    return (
        dashboard.QueryVariable(MODEL_VARIABLE)
        .label("Model")
        .description("Model (one consumer group); the list comes from ClickHouse for the time range.")
        .datasource(DATASOURCE)
        .query(query_sql(MODELS_QUERY))
        .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC)
        .include_all(False)
        .multi(False)
    )


def build_board(spec: BoardSpec) -> dict[str, Any]:
    """The dashboard model (plain JSON-ready dict) for one board.

    It is the classic (v1) dashboard model on purpose: file provisioning and
    /api/dashboards/db take it on every Grafana version, so the SDK's hint to
    prefer its v2 schema is silenced.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="grafana_foundation_sdk")
        return _build_v1(spec)


def _build_v1(spec: BoardSpec) -> dict[str, Any]:
    board = (
        dashboard.Dashboard(spec.title)
        .uid(spec.uid)
        .description(spec.description)
        .tags(list(spec.tags))
        .editable()
        .time(spec.default_range, "now")
        .refresh(spec.refresh)
        .timezone("browser")
        .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
        .with_variable(_model_variable())
    )
    for panel_id, panel_spec in enumerate(spec.panels, start=1):
        board = board.with_panel(_panel(panel_spec, panel_id))
    encoded = json.dumps(board.build(), cls=JSONEncoder, sort_keys=True)
    model: dict[str, Any] = json.loads(encoded)
    return model


def render(model: dict[str, Any]) -> str:
    return json.dumps(model, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def board_path(spec: BoardSpec) -> Path:
    return DASHBOARDS_DIR / f"{spec.uid}.json"


class DashboardLintError(ValueError):
    """A generated dashboard failed lint; it is never written or pushed."""


def checked_board(spec: BoardSpec) -> dict[str, Any]:
    """Build a board and refuse it when lint finds a problem."""
    model = build_board(spec)
    problems = lint_dashboard(model)
    if problems:
        raise DashboardLintError(f"{spec.uid}: " + "; ".join(problems))
    return model


ALERTING_HEADER = """\
# Grafana alert rules, generated from {source} by `batchtide dashboards generate`
# (dashboards/alerts.py): do not edit here. Grafana loads this file from
# /etc/grafana/provisioning/alerting (docker-compose.yml mounts dashboards/provisioning there).
"""


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the SQL) as YAML block scalars, so the file reads like the code."""


_BlockDumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def alerting_path() -> Path:
    return DASHBOARDS_DIR / "provisioning" / "alerting" / "batchtide.yaml"


def default_config_path() -> Path:
    """The repository's example config (what docker-compose runs); alerts come from its models."""
    return DASHBOARDS_DIR.parent / "batchtide.toml"


def alerting_text(config: Config, source: str) -> str:
    """The alerting provisioning file for `config`, refused when lint finds a problem."""
    document = alert_provisioning(config)
    problems = lint_alert_rules(document)
    if problems:
        raise DashboardLintError("alert rules: " + "; ".join(problems))
    body = yaml.dump(document, Dumper=_BlockDumper, sort_keys=False, width=120, allow_unicode=True)
    return ALERTING_HEADER.format(source=source) + body


def generated_files(config_path: Path | None = None) -> dict[Path, str]:
    """Every generated file and the text it must hold; alert rules from `config_path`
    (default: the repository's batchtide.toml, or the built-in defaults when it is absent)."""
    files = {board_path(spec): render(checked_board(spec)) for spec in BOARDS}
    path = config_path or default_config_path()
    config = load_config(path if path.exists() else None)
    files[alerting_path()] = alerting_text(config, path.name if config_path is None else str(path))
    return files


def stale_files(config_path: Path | None = None) -> list[Path]:
    """Committed files whose text differs from a fresh generation."""
    stale = []
    for path, text in generated_files(config_path).items():
        if not path.exists() or path.read_text() != text:
            stale.append(path)
    return stale


def write_all(config_path: Path | None = None) -> list[Path]:
    written = []
    for path, text in generated_files(config_path).items():
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(path)
    return written


def main(argv: list[str]) -> int:
    if "--check" in argv:
        stale = stale_files()
        for path in stale:
            print(f"stale: {path} (run `batchtide dashboards generate`)")
        return 1 if stale else 0
    for path in write_all():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
