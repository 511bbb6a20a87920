"""Expand Grafana ClickHouse-plugin SQL the way Grafana and the plugin do.

Panel SQL (pipeline/core/store/queries.py) is written once, with the plugin's
macros, and run by both Grafana and `batchtide report`. To run it outside
Grafana we reproduce the two expansion steps faithfully:

1. Grafana's frontend (the plugin's `applyTemplateVariables`):
   `$__conditionalAll(condition, $var)` becomes `1=1` when the variable is
   empty or "All", else the condition; then template variables (`$var`,
   `${var}`, `${var:format}`, `[[var]]`) and the global ones (`$__from`,
   `$__to`, `$__interval`, `$__interval_ms`) are substituted. Without a
   format the plugin joins multi-values as `'a','b'` and leaves a single
   value raw; formats `sqlstring`, `singlequote`, `doublequote`, `csv`,
   `pipe` and `raw` behave as in Grafana.
2. The plugin's backend macros (grafana/clickhouse-datasource pkg/macros,
   parsed as grafana-plugin-sdk-go sqlutil does: arguments only when `(`
   follows the name immediately, nested parentheses kept, top-level commas
   split, arguments trimmed): `$__timeFilter(c)` -> `c >= toDateTime(s) AND
   c <= toDateTime(s)`, `$__timeFilter_ms`, `$__fromTime`, `$__toTime`,
   `$__fromTime_ms`, `$__toTime_ms`, `$__dateFilter`, `$__dateTimeFilter` /
   `$__dt`, `$__timeInterval(c)` -> `toStartOfInterval(toDateTime(c),
   INTERVAL n second)`, `$__timeInterval_ms`, `$__interval_s`.

`report` needs user input bound, never spliced: a `Bound` variable value
expands to a ClickHouse query parameter placeholder (`{model:String}`),
whatever format the SQL asks for, and the value goes in `parameters=`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime


class MacroError(ValueError):
    """The SQL uses a macro wrongly (argument count, unbalanced parentheses, unknown format)."""


@dataclass(frozen=True)
class Bound:
    """A template variable whose value is passed as a server-side query parameter."""

    name: str
    type: str = "String"

    @property
    def placeholder(self) -> str:
        return "{" + f"{self.name}:{self.type}" + "}"


VariableValue = str | Sequence[str] | Bound
ALL_VALUE = "$__all"

_VARIABLE = re.compile(r"\$(\w+)|\[\[(\w+?)(?::(\w+))?\]\]|\$\{(\w+)(?:\.([^:^}]+))?(?::([^}]+))?\}")


def _format_value(value: str | Sequence[str], fmt: str | None) -> str:
    values = [value] if isinstance(value, str) else list(value)
    if fmt is None:  # the plugin's own formatter
        return value if isinstance(value, str) else "'" + "','".join(values) + "'"
    if fmt == "raw":
        return ",".join(values)
    if fmt == "csv":
        return ",".join(values)
    if fmt == "pipe":
        return "|".join(values)
    if fmt == "sqlstring":
        return ",".join("'" + v.replace("'", "''") + "'" for v in values)
    if fmt == "singlequote":
        return ",".join("'" + v.replace("'", "\\'") + "'" for v in values)
    if fmt == "doublequote":
        return ",".join('"' + v.replace('"', '\\"') + '"' for v in values)
    raise MacroError(f"unsupported variable format {fmt!r}")


def grafana_interval(interval_ms: int) -> str:
    """`$__interval` text: the largest whole unit, as Grafana's secondsToHms writes it."""
    seconds = interval_ms / 1000
    for unit, size in (("y", 31_536_000), ("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)):
        whole = int(seconds // size)
        if whole:
            return f"{whole}{unit}"
    return f"{int(interval_ms)}ms" if interval_ms >= 1 else "less than a millisecond"


def _split_args(text: str) -> list[str]:
    args: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in text:
        if ch == "," and depth == 0:
            args.append("".join(current).strip())
            current = []
            continue
        depth += ch == "("
        depth -= ch == ")"
        current.append(ch)
    args.append("".join(current).strip())
    return args


def _macro_calls(sql: str, name: str) -> list[tuple[int, int, list[str]]]:
    """(start, end, args) of each `$__name` call; args only when '(' follows at once."""
    calls = []
    for match in re.finditer(rf"\$__{re.escape(name)}\b", sql):
        start, end = match.start(), match.end()
        args: list[str] = []
        if end < len(sql) and sql[end] == "(":
            depth = 0
            for i in range(end, len(sql)):
                depth += sql[i] == "("
                depth -= sql[i] == ")"
                if depth == 0:
                    args = _split_args(sql[end + 1 : i])
                    end = i + 1
                    break
            else:
                raise MacroError(f"$__{name}: missing closing parenthesis")
        calls.append((start, end, args))
    return calls


def _conditional_all(sql: str, variables: Mapping[str, VariableValue]) -> str:
    marker = "$__conditionalAll("
    while (index := sql.rfind(marker)) != -1:
        _, end, args = _macro_calls(sql[index:], "conditionalAll")[0]
        if len(args) != 2:
            raise MacroError("$__conditionalAll expects (condition, $variable)")
        name = args[1].lstrip("$").strip("{}")
        value = variables.get(name, "")
        everything = not isinstance(value, Bound) and (value in ("", ALL_VALUE) or list(value) == [ALL_VALUE])
        phrase = "1=1" if everything else sql[index + len(marker) : index + end - 1].rsplit(",", 1)[0]
        sql = sql[:index] + phrase + sql[index + end :]
    return sql


def _template_variables(sql: str, variables: Mapping[str, VariableValue]) -> str:
    def substitute(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2) or match.group(4)
        fmt = match.group(3) or match.group(6)
        if name not in variables:
            return match.group(0)
        value = variables[name]
        if isinstance(value, Bound):
            return value.placeholder
        return _format_value(value, fmt)

    return _VARIABLE.sub(substitute, sql)


def _utc(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def _backend_macros(time_from_ms: int, time_to_ms: int, interval_ms: int) -> dict[str, Callable[[list[str]], str]]:
    seconds = max(int(interval_ms // 1000), 1)
    millis = max(int(interval_ms), 1)
    f_s, t_s = time_from_ms // 1000, time_to_ms // 1000
    f_date, t_date = _utc(time_from_ms).strftime("%Y-%m-%d"), _utc(time_to_ms).strftime("%Y-%m-%d")

    def one(name: str, build: Callable[[str], str]) -> Callable[[list[str]], str]:
        def expand(args: list[str]) -> str:
            if len(args) != 1:
                raise MacroError(f"$__{name}: expected 1 argument, received {len(args)}")
            return build(args[0])

        return expand

    def date_time_filter(args: list[str]) -> str:
        if len(args) != 2:
            raise MacroError(f"$__dateTimeFilter: expected 2 arguments, received {len(args)}")
        d, t = args
        return (
            f"({d} >= toDate('{f_date}') AND {d} <= toDate('{t_date}')) AND "
            f"({t} >= toDateTime({f_s}) AND {t} <= toDateTime({t_s}))"
        )

    return {
        "fromTime": lambda _: f"toDateTime({f_s})",
        "toTime": lambda _: f"toDateTime({t_s})",
        "fromTime_ms": lambda _: f"fromUnixTimestamp64Milli({time_from_ms})",
        "toTime_ms": lambda _: f"fromUnixTimestamp64Milli({time_to_ms})",
        "timeFilter": one("timeFilter", lambda c: f"{c} >= toDateTime({f_s}) AND {c} <= toDateTime({t_s})"),
        "timeFilter_ms": one(
            "timeFilter_ms",
            lambda c: (
                f"{c} >= fromUnixTimestamp64Milli({time_from_ms}) AND {c} <= fromUnixTimestamp64Milli({time_to_ms})"
            ),
        ),
        "dateFilter": one("dateFilter", lambda c: f"{c} >= toDate('{f_date}') AND {c} <= toDate('{t_date}')"),
        "dateTimeFilter": date_time_filter,
        "dt": date_time_filter,
        "timeInterval": one("timeInterval", lambda c: f"toStartOfInterval(toDateTime({c}), INTERVAL {seconds} second)"),
        "timeInterval_ms": one(
            "timeInterval_ms", lambda c: f"toStartOfInterval(toDateTime64({c}, 3), INTERVAL {millis} millisecond)"
        ),
        "interval_s": lambda _: str(seconds),
    }


def expand_macros(
    sql: str,
    *,
    time_from_ms: int,
    time_to_ms: int,
    interval_ms: int,
    variables: Mapping[str, VariableValue] | None = None,
) -> str:
    """Panel SQL as ClickHouse receives it from Grafana for this time range and interval."""
    user = dict(variables or {})
    sql = _conditional_all(sql, user)
    builtins: dict[str, VariableValue] = {
        "__from": str(time_from_ms),
        "__to": str(time_to_ms),
        "__interval": grafana_interval(interval_ms),
        "__interval_ms": str(int(interval_ms)),
    }
    sql = _template_variables(sql, {**builtins, **user})
    for name, expand in _backend_macros(time_from_ms, time_to_ms, interval_ms).items():
        for start, end, args in reversed(_macro_calls(sql, name)):
            sql = sql[:start] + expand(args) + sql[end:]
    return sql
