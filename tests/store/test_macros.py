"""Macro expansion matches the Grafana ClickHouse plugin (cases from its own tests and docs)."""

from __future__ import annotations

import pytest

from pipeline.core.store.macros import ALL_VALUE, Bound, MacroError, expand_macros, grafana_interval

FROM_MS = 1415792726371  # 2014-11-12T11:45:26.371Z
TO_MS = 1447328726371  # 2015-11-12T11:45:26.371Z


def expand(sql: str, interval_ms: int = 20_000, **variables: object) -> str:
    return expand_macros(sql, time_from_ms=FROM_MS, time_to_ms=TO_MS, interval_ms=interval_ms, variables=variables)  # type: ignore[arg-type]


def test_time_macros_as_the_plugin_writes_them() -> None:
    assert expand("$__fromTime") == "toDateTime(1415792726)"
    assert expand("$__toTime") == "toDateTime(1447328726)"
    assert expand("$__fromTime_ms") == "fromUnixTimestamp64Milli(1415792726371)"
    assert expand("WHERE $__timeFilter(ts)") == "WHERE ts >= toDateTime(1415792726) AND ts <= toDateTime(1447328726)"
    assert expand("$__timeFilter_ms(ts)") == (
        "ts >= fromUnixTimestamp64Milli(1415792726371) AND ts <= fromUnixTimestamp64Milli(1447328726371)"
    )
    assert expand("$__dateFilter(d)") == "d >= toDate('2014-11-12') AND d <= toDate('2015-11-12')"
    assert expand("$__dt(d, t)") == (
        "(d >= toDate('2014-11-12') AND d <= toDate('2015-11-12')) AND "
        "(t >= toDateTime(1415792726) AND t <= toDateTime(1447328726))"
    )


def test_interval_macros() -> None:
    assert expand("$__timeInterval(col)") == "toStartOfInterval(toDateTime(col), INTERVAL 20 second)"
    assert expand("$__timeInterval_ms(col)") == "toStartOfInterval(toDateTime64(col, 3), INTERVAL 20000 millisecond)"
    assert expand("x / $__interval_s") == "x / 20"
    assert expand("$__interval_s", interval_ms=250) == "1", "the plugin never goes below one second"
    assert expand("$__interval $__interval_ms", interval_ms=90_000) == "1m 90000"
    assert grafana_interval(500) == "500ms" and grafana_interval(7_200_000) == "2h"


def test_argument_parsing_follows_sqlutil() -> None:
    assert expand("$__timeFilter(toDateTime(a, 'UTC') )") == (
        "toDateTime(a, 'UTC') >= toDateTime(1415792726) AND toDateTime(a, 'UTC') <= toDateTime(1447328726)"
    )
    assert expand("$__fromTime (1)") == "toDateTime(1415792726) (1)", "args only when '(' follows at once"
    assert expand("$__timeFilterEpoch(x)") == "$__timeFilterEpoch(x)", "a longer name is not this macro"
    with pytest.raises(MacroError):
        expand("$__timeFilter(a")
    with pytest.raises(MacroError):
        expand("$__dt(a)")


def test_template_variables_and_formats() -> None:
    assert expand("m = '$model'", model="a") == "m = 'a'"
    assert expand("m IN ($model)", model=["a", "b"]) == "m IN ('a','b')", "the plugin's own multi-value format"
    assert expand("m IN (${model:sqlstring})", model=["a", "o'b"]) == "m IN ('a','o''b')"
    assert expand("${model:csv}|${model:pipe}|[[model]]", model=["a", "b"]) == "a,b|a|b|'a','b'"
    assert expand("$unknown stays") == "$unknown stays"
    assert expand("$__from..$__to") == f"{FROM_MS}..{TO_MS}"
    with pytest.raises(MacroError):
        expand("${model:nosuchformat}", model="a")


def test_conditional_all() -> None:
    sql = "WHERE $__conditionalAll(model IN (${model:sqlstring}), $model) AND ok"
    assert expand(sql, model=ALL_VALUE) == "WHERE 1=1 AND ok"
    assert expand(sql, model="") == "WHERE 1=1 AND ok"
    assert expand(sql, model=["a", "b"]) == "WHERE model IN ('a','b') AND ok"


def test_bound_variables_become_query_parameters_whatever_the_format() -> None:
    sql = "WHERE $__conditionalAll(model IN (${model:sqlstring}), $model) AND m = $model AND [[model]]"
    assert expand(sql, model=Bound("model")) == (
        "WHERE model IN ({model:String}) AND m = {model:String} AND {model:String}"
    )
