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
MODEL_REFERENCE = re.compile(
    rf"\$\{{{MODEL_VARIABLE}(:\w+)?\}}|\${MODEL_VARIABLE}\b|\[\[{MODEL_VARIABLE}(:\w+)?\]\]"
)


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
