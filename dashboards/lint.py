"""Checks a Grafana dashboard model for the mistakes that make a panel silently empty.

Grafana accepts almost any JSON and shows "No data" or a broken panel at view
time; these checks catch the same mistakes at build time: a panel pointing at
another datasource, duplicate refIds, panels overlapping on the grid, values
without a unit, targets that ignore the time picker or the model variable.
"""

from __future__ import annotations

import re
from typing import Any

from dashboards.panels import DATASOURCE_TYPE, DATASOURCE_UID, MODEL_VARIABLE

GRID_COLUMNS = 24
TIME_MACROS = ("$__timeFilter", "$__fromTime", "$__toTime")
MODEL_REFERENCE = re.compile(rf"\$\{{{MODEL_VARIABLE}(:\w+)?\}}|\${MODEL_VARIABLE}\b|\[\[{MODEL_VARIABLE}(:\w+)?\]\]")


def _datasource_problems(where: str, datasource: Any) -> list[str]:
    if not isinstance(datasource, dict):
        return [f"{where}: no datasource reference (expected uid {DATASOURCE_UID!r})"]
    problems = []
    if datasource.get("type") != DATASOURCE_TYPE:
        problems.append(f"{where}: datasource type {datasource.get('type')!r}, expected {DATASOURCE_TYPE!r}")
    if datasource.get("uid") != DATASOURCE_UID:
        problems.append(f"{where}: datasource uid {datasource.get('uid')!r}, expected {DATASOURCE_UID!r}")
    return problems


def _target_problems(where: str, panel: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    targets = panel.get("targets") or []
    if not targets:
        return [f"{where}: no targets"]
    seen: set[str] = set()
    for target in targets:
        ref_id = target.get("refId")
        at = f"{where} target {ref_id!r}"
        if not ref_id:
            problems.append(f"{where}: a target has no refId")
        elif ref_id in seen:
            problems.append(f"{where}: duplicate refId {ref_id!r}")
        seen.add(str(ref_id))
        if "datasource" in target:
            problems += _datasource_problems(at, target["datasource"])
        sql = str(target.get("rawSql") or "")
        if not sql.strip():
            problems.append(f"{at}: empty rawSql")
            continue
        if target.get("editorType") != "sql":
            problems.append(f"{at}: editorType {target.get('editorType')!r}, expected 'sql'")
        if target.get("format") not in (0, 1):
            problems.append(f"{at}: format {target.get('format')!r}, expected 0 (time series) or 1 (table)")
        if panel.get("type") == "timeseries" and target.get("format") != 0:
            problems.append(f"{at}: a time series panel needs format 0")
        if not any(macro in sql for macro in TIME_MACROS):
            problems.append(f"{at}: rawSql ignores the dashboard time range (no $__timeFilter)")
        if not MODEL_REFERENCE.search(sql):
            problems.append(f"{at}: rawSql ignores the ${MODEL_VARIABLE} variable")
    return problems


def _unit_problems(where: str, panel: dict[str, Any]) -> list[str]:
    defaults = (panel.get("fieldConfig") or {}).get("defaults") or {}
    if not str(defaults.get("unit") or "").strip():
        return [f"{where}: no unit in fieldConfig.defaults"]
    return []


def _grid_problems(panels: list[dict[str, Any]]) -> list[str]:
    problems: list[str] = []
    placed: list[tuple[str, int, int, int, int]] = []
    for panel in panels:
        where = f"panel {panel.get('title')!r}"
        grid = panel.get("gridPos")
        if not isinstance(grid, dict) or not all(isinstance(grid.get(k), int) for k in ("x", "y", "w", "h")):
            problems.append(f"{where}: missing or incomplete gridPos")
            continue
        x, y, w, h = grid["x"], grid["y"], grid["w"], grid["h"]
        if w <= 0 or h <= 0 or x < 0 or y < 0 or x + w > GRID_COLUMNS:
            problems.append(f"{where}: gridPos {grid} outside the {GRID_COLUMNS}-column grid")
        for other, ox, oy, ow, oh in placed:
            if x < ox + ow and ox < x + w and y < oy + oh and oy < y + h:
                problems.append(f"{where}: gridPos overlaps panel {other!r}")
        placed.append((str(panel.get("title")), x, y, w, h))
    return problems


def lint_dashboard(model: dict[str, Any]) -> list[str]:
    """Every problem found, as readable sentences; empty when the dashboard is sound."""
    problems: list[str] = []
    if not model.get("uid"):
        problems.append("dashboard has no uid (pushes would create duplicates)")
    panels = [p for p in model.get("panels") or [] if p.get("type") != "row"]
    if not panels:
        problems.append("dashboard has no panels")
    ids: set[Any] = set()
    for panel in panels:
        where = f"panel {panel.get('title')!r}"
        if panel.get("id") in ids:
            problems.append(f"{where}: duplicate panel id {panel.get('id')!r}")
        ids.add(panel.get("id"))
        if not str(panel.get("description") or "").strip():
            problems.append(f"{where}: no description telling how to read it")
        problems += _datasource_problems(where, panel.get("datasource"))
        problems += _target_problems(where, panel)
        problems += _unit_problems(where, panel)
    problems += _grid_problems(panels)
    for variable in (model.get("templating") or {}).get("list") or []:
        if variable.get("type") == "query":
            problems += _datasource_problems(f"variable {variable.get('name')!r}", variable.get("datasource"))
    return problems


ALERT_EXPRESSION_UID = "__expr__"
DURATION = re.compile(r"^\d+[smhd]$")


def _alert_rule_problems(where: str, rule: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    data = rule.get("data") or []
    refs = [d.get("refId") for d in data]
    if len(set(refs)) != len(refs):
        problems.append(f"{where}: duplicate refId in {refs}")
    if rule.get("condition") not in refs:
        problems.append(f"{where}: condition {rule.get('condition')!r} names no query (refIds {refs})")
    if not DURATION.match(str(rule.get("for", ""))):
        problems.append(f"{where}: `for` {rule.get('for')!r} is not a duration like 5m")
    if not str((rule.get("annotations") or {}).get("summary") or "").strip():
        problems.append(f"{where}: no summary annotation telling the on-call what fired")
    if not (rule.get("labels") or {}).get("severity"):
        problems.append(f"{where}: no severity label (notification policies route on it)")
    for query in data:
        at = f"{where} query {query.get('refId')!r}"
        model = query.get("model") or {}
        if query.get("datasourceUid") == ALERT_EXPRESSION_UID:
            if model.get("expression") not in refs:
                problems.append(f"{at}: expression input {model.get('expression')!r} is not a query of this rule")
            continue
        if query.get("datasourceUid") != DATASOURCE_UID:
            problems.append(f"{at}: datasourceUid {query.get('datasourceUid')!r}, expected {DATASOURCE_UID!r}")
        problems += _datasource_problems(at, model.get("datasource"))
        sql = str(model.get("rawSql") or "")
        if not sql.strip():
            problems.append(f"{at}: empty rawSql")
            continue
        if model.get("editorType") != "sql" or model.get("format") != 1:
            problems.append(f"{at}: needs editorType 'sql' and format 1 (table: one number per model)")
        if not any(macro in sql for macro in TIME_MACROS):
            problems.append(f"{at}: rawSql ignores the rule's time range (no $__timeFilter)")
        if MODEL_REFERENCE.search(sql):
            problems.append(f"{at}: alert queries have no dashboard variables, but rawSql uses ${MODEL_VARIABLE}")
        window = (query.get("relativeTimeRange") or {}).get("from")
        if not isinstance(window, int) or window <= 0:
            problems.append(f"{at}: relativeTimeRange.from must be a positive number of seconds")
    return problems


def lint_alert_rules(document: dict[str, Any]) -> list[str]:
    """Problems of a Grafana alerting provisioning document, as sentences; empty when sound."""
    problems: list[str] = []
    if document.get("apiVersion") != 1:
        problems.append(f"apiVersion {document.get('apiVersion')!r}, expected 1")
    groups = document.get("groups") or []
    if not groups:
        problems.append("no rule groups")
    uids: set[str] = set()
    for group in groups:
        name = group.get("name")
        if not name or not group.get("folder") or not DURATION.match(str(group.get("interval", ""))):
            problems.append(f"group {name!r}: needs a name, a folder and an interval like 1m")
        if not group.get("rules"):
            problems.append(f"group {name!r}: no rules")
        for rule in group.get("rules") or []:
            uid = str(rule.get("uid") or "")
            where = f"rule {rule.get('title')!r}"
            if not uid or len(uid) > 40:
                problems.append(f"{where}: uid {uid!r} must be 1-40 characters")
            elif uid in uids:
                problems.append(f"{where}: duplicate uid {uid!r}")
            uids.add(uid)
            problems += _alert_rule_problems(where, rule)
    return problems
