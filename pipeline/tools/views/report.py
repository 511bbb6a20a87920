"""`batchtide report`: the board's numbers in a terminal (rich tables) or as JSON.

It runs the very SQL texts the Grafana panels run (pipeline/core/store/queries.py),
expanded with the plugin's macro rules for the chosen range; the model name
is bound as a ClickHouse query parameter, never spliced into the SQL.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from clickhouse_connect.driver.client import Client
from rich.console import Console
from rich.table import Table

from pipeline.core.config import BatchProfile
from pipeline.core.store.macros import ALL_VALUE, Bound, expand_macros
from pipeline.core.store.queries import QUERIES, REPORT_QUERIES, SLO
from pipeline.tools.views.tables import print_table

NICE_INTERVALS_S = (1, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)
DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)\s*$")
UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}


def parse_duration_ms(text: str) -> int:
    """'15m' -> 900000; units ms, s, m, h, d, w."""
    match = DURATION.match(text)
    if not match:
        raise ValueError(f"duration {text!r}: expected a number and a unit (ms, s, m, h, d, w), e.g. 15m")
    value = int(float(match.group(1)) * UNIT_MS[match.group(2)])
    if value <= 0:
        raise ValueError(f"duration {text!r} must be > 0")
    return value


def pick_interval_ms(span_ms: int, buckets: int = 12) -> int:
    """The smallest round bucket giving at most about `buckets` rows per model."""
    for seconds in NICE_INTERVALS_S:
        if span_ms / (seconds * 1000) <= buckets:
            return seconds * 1000
    return NICE_INTERVALS_S[-1] * 1000


@dataclass
class Report:
    time_from_ms: int
    time_to_ms: int
    interval_ms: int
    model: str | None
    sections: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    query_ms: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        def plain(value: Any) -> Any:
            if isinstance(value, float) and not math.isfinite(value):
                return None
            if isinstance(value, datetime):
                return value.replace(tzinfo=UTC).isoformat()
            return value

        body = {
            "time_from": plain(datetime.fromtimestamp(self.time_from_ms / 1000, tz=UTC)),
            "time_to": plain(datetime.fromtimestamp(self.time_to_ms / 1000, tz=UTC)),
            "interval_s": self.interval_ms / 1000,
            "model": self.model,
            "sections": {
                name: [{k: plain(v) for k, v in row.items()} for row in rows] for name, rows in self.sections.items()
            },
        }
        return json.dumps(body, indent=2)


@dataclass(frozen=True)
class Objective:
    """A model's end-to-end objective: slo_p99_ms plus slo_ms_per_new_token per generated token."""

    base_ms: float
    per_new_token_ms: float = 0.0


def run_query(
    client: Client,
    name: str,
    *,
    time_from_ms: int,
    time_to_ms: int,
    interval_ms: int,
    model: str | None,
    objectives: dict[str, Objective] | None = None,
) -> list[dict[str, Any]]:
    """One named analysis query for a range; `model` None means all models. `objectives` runs the SLO query."""
    query = SLO if name == SLO.name else QUERIES[name]
    sql = expand_macros(
        query.sql,
        time_from_ms=time_from_ms,
        time_to_ms=time_to_ms,
        interval_ms=interval_ms,
        variables={"model": Bound("model") if model is not None else ALL_VALUE},
    )
    parameters: dict[str, Any] = {"model": model} if model is not None else {}
    if query is SLO:
        objectives = objectives or {}
        parameters.update(
            slo_models=list(objectives),
            slo_base=[o.base_ms for o in objectives.values()],
            slo_per_token=[o.per_new_token_ms for o in objectives.values()],
            slo_default=BatchProfile().slo_p99_ms,
        )
    return list(client.query(sql, parameters=parameters).named_results())


def run_report(
    client: Client,
    *,
    time_from_ms: int,
    time_to_ms: int,
    model: str | None = None,
    interval_ms: int | None = None,
    names: tuple[str, ...] = REPORT_QUERIES,
    objectives: dict[str, Objective] | None = None,
) -> Report:
    """`objectives` (per model; unnamed models get slo_p99_ms's default) adds the SLO section."""
    interval = interval_ms or pick_interval_ms(time_to_ms - time_from_ms)
    report = Report(time_from_ms, time_to_ms, interval, model)
    if objectives is not None:
        names = (*names, SLO.name)
    for name in names:
        started = time.perf_counter()
        report.sections[name] = run_query(
            client,
            name,
            time_from_ms=time_from_ms,
            time_to_ms=time_to_ms,
            interval_ms=interval,
            model=model,
            objectives=objectives,
        )
        report.query_ms[name] = (time.perf_counter() - started) * 1000
    return report


def _num(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


def _pct(value: Any) -> str:
    return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value * 100:.2f}%"


def _mib(value: Any) -> str:
    return "-" if value is None else f"{float(value) / 2**20:,.0f} MiB"


def _table(title: str, columns: list[str], rows: list[list[str]]) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    return table


def render(report: Report, console: Console) -> None:
    """Rich tables, most telling first: summary, latency over time, batches, memory, cost curve."""
    span = f"{datetime.fromtimestamp(report.time_from_ms / 1000, tz=UTC):%Y-%m-%d %H:%M:%S} .. " \
        f"{datetime.fromtimestamp(report.time_to_ms / 1000, tz=UTC):%H:%M:%S} UTC"  # fmt: skip
    s = report.sections
    if not s.get("summary"):
        console.print(f"no latency rows in {span} (is the sink running? try a longer --since)")
        if s.get("lag_summary"):  # nothing answered, but consumers reported: the lag says why
            _render_lag(s, console)
        return
    console.print(f"[bold]batchtide report[/bold]  {span}, buckets of {report.interval_ms / 1000:g} s")
    print_table(console, _table("Per model (ms; req/s over the span with data)", [
        "model", "requests", "span s", "req/s", "tokens/s", "e2e p50", "e2e p99", "e2e p999", "wait p50", "wait p99", "wait p999",
    ], [[
        r["model"], _num(r["requests"]), _num(r["span_s"]), _num(r["requests_per_s"]), _num(r["tokens_per_s"], 0),
        _num(r["e2e_p50_ms"]), _num(r["e2e_p99_ms"]), _num(r["e2e_p999_ms"]),
        _num(r["wait_p50_ms"]), _num(r["wait_p99_ms"]), _num(r["wait_p999_ms"]),
    ] for r in s["summary"]]))  # fmt: skip
    if s.get("generation"):
        print_table(console, _table("Generation (prompt and generated tokens apart; TTFT = first token - enqueue, "
                             "TPOT = per output token after the first; ms)", [
            "model", "requests", "prompt tok/s", "generated tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
        ], [[
            r["model"], _num(r["requests"]), _num(r["prompt_tokens_per_s"], 0), _num(r["generated_tokens_per_s"], 0),
            _num(r["ttft_p50_ms"]), _num(r["ttft_p99_ms"]), _num(r["tpot_p50_ms"], 2), _num(r["tpot_p99_ms"], 2),
        ] for r in s["generation"]]))  # fmt: skip
    if s.get("slo"):
        print_table(console, _table("SLO (slo_p99_ms + generated tokens x slo_ms_per_new_token; met when p99/SLO <= 1)", [
            "model", "SLO ms", "+ ms/token", "within SLO", "p99 / SLO",
        ], [[
            r["model"], _num(r["slo_p99_ms"], 0), _num(r["slo_ms_per_new_token"]), _pct(r["within_slo_share"]),
            _num(r["p99_over_slo"], 2),
        ] for r in s["slo"]]))  # fmt: skip
    if s.get("warmup"):
        print_table(console, _table("Warm-up requests (not in any figure above or below)", ["model", "requests", "e2e p50 ms", "e2e max ms"], [
            [r["model"], _num(r["requests"]), _num(r["e2e_p50_ms"]), _num(r["e2e_max_ms"])] for r in s["warmup"]
        ]))  # fmt: skip
    print_table(console, _table("Tails and outcomes (not ok: every outcome but ok, refusals included)", [
        "model", "waited > 1 s", "tail-marked", "marked wait p99 ms", "unmarked wait p99 ms", "not ok", "refused",
    ], [[
        r["model"], _pct(r["share_wait_over_1s"]), _pct(r["marked_share"]),
        _num(r["marked_wait_p99_ms"]), _num(r["unmarked_wait_p99_ms"]), _pct(r["not_ok_share"]), _num(r["refused"]),
    ] for r in s["summary"]]))  # fmt: skip
    if s.get("not_ok_reasons"):
        print_table(console, _table("Not ok by outcome and reason (share of all the model's requests)", [
            "model", "outcome", "reason", "requests", "share",
        ], [[r["model"], r["outcome"], r["reason"], _num(r["requests"]), _pct(r["share"])]
            for r in s["not_ok_reasons"]]))  # fmt: skip
    if s.get("consumers"):
        _render_consumers(s["consumers"], console)
    throughput = {(r["time"], r["model"]): r for r in s.get("throughput", [])}
    print_table(console, _table("Latency per bucket (ms)", [
        "time", "model", "req/s", "tokens/s", "e2e p50", "e2e p99", "e2e p999", "wait p50", "wait p99", "wait p999",
    ], [[
        f"{r['time']:%H:%M:%S}", r["model"],
        _num(throughput.get((r["time"], r["model"]), {}).get("requests_per_s")),
        _num((lambda t: t and t["tokens_in_per_s"] + t["tokens_out_per_s"])(throughput.get((r["time"], r["model"]))), 0),
        _num(r["e2e_p50_ms"]), _num(r["e2e_p99_ms"]), _num(r["e2e_p999_ms"]),
        _num(r["wait_p50_ms"]), _num(r["wait_p99_ms"]), _num(r["wait_p999_ms"]),
    ] for r in s.get("latency_quantiles", [])]))  # fmt: skip
    print_table(console, _table("Target hit ratio (busy: one device cycle brings a full target)", [
        "model", "load", "batches", "hit ratio", "mean size",
    ], [[r["model"], r["load"], _num(r["batches"]), _pct(r["hit_ratio"]), _num(r["mean_size"])]
        for r in s.get("target_hit_ratio", [])]))  # fmt: skip
    print_table(console, _table("Dispatch reasons", ["model", "reason", "batches", "share"], [
        [r["model"], r["reason"], _num(r["batches"]), _pct(r["share"])] for r in s.get("dispatch_reasons", [])
    ]))  # fmt: skip
    print_table(console, _table("Batch size distribution (sizes with >= 2% of batches, one # per 2.5%; --json for all)", [
        "model", "size", "batches", "share", "",
    ], [[r["model"], str(r["size"]), _num(r["batches"]), _pct(r["share"]), "#" * round(r["share"] * 40)]
        for r in s.get("batch_sizes", []) if r["share"] >= 0.02]))  # fmt: skip
    print_table(console, _table("Device memory per batch", ["model", "kind", "p50", "max"], [
        [r["model"], r["device_mem_kind"], _mib(r["mem_p50_bytes"]), _mib(r["mem_max_bytes"])]
        for r in s.get("device_memory", [])
    ]))  # fmt: skip
    _render_lag(s, console)
    print_table(console, _table("Compute time by batch size (every 8th size; --json for all)", [
        "model", "size", "batches", "p50 ms", "p99 ms", "ms/request",
    ], [[r["model"], str(r["size"]), _num(r["batches"]), _num(r["compute_p50_ms"]), _num(r["compute_p99_ms"]),
         _num(r["ms_per_request_p50"], 2)]
        for r in s.get("compute_by_batch_size", []) if r["size"] == 1 or r["size"] % 8 == 0]))  # fmt: skip


def _ms(value: Any) -> str:
    """A latency an operator compares at a glance: 70 ms, 1.4 s."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:,.0f} ms" if value < 1000 else f"{value / 1000:,.2f} s"


def consumer_line(rows: list[dict[str, Any]]) -> str:
    """One model's consumers by p99, slowest first: `c1: p99 1.40 s, c0: p99 70 ms`."""
    ranked = sorted(rows, key=lambda r: -(r["e2e_p99_ms"] if math.isfinite(r["e2e_p99_ms"]) else -1.0))
    return ", ".join(f"{r['consumer_id']}: p99 {_ms(r['e2e_p99_ms'])}" for r in ranked)


def _render_consumers(rows: list[dict[str, Any]], console: Console) -> None:
    """Per consumer: its requests and share, latency, throughput, mean batch and measured capacity."""
    print_table(console, _table("By consumer (share of the model's requests that ran; capacity: latest measured, "
                                "- before the first)", [
        "consumer", "model", "requests", "share", "e2e p50", "e2e p99", "req/s", "mean batch", "capacity/s", "not ok",
    ], [[
        r["consumer_id"], r["model"], _num(r["requests"]), _pct(r["share"]), _ms(r["e2e_p50_ms"]),
        _ms(r["e2e_p99_ms"]), _num(r["requests_per_s"]), _num(r["mean_batch_size"]),
        _num(r["capacity_per_s"]) if r["capacity_per_s"] else "-", _pct(r["not_ok_share"]),
    ] for r in rows]))  # fmt: skip
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        if len(mine) > 1:
            console.print(f"{model} by consumer: {consumer_line(mine)}")


def _age(ms: Any) -> str:
    if ms is None or (isinstance(ms, float) and not math.isfinite(ms)):
        return "-"
    return f"{ms:,.0f} ms" if ms < 1000 else f"{ms / 1000:,.1f} s"


def _render_lag(s: dict[str, list[dict[str, Any]]], console: Console) -> None:
    """Consumer lag (records not yet answered) and lag age (how old the oldest of them is)."""
    if not s.get("lag_summary"):
        console.print("Consumer lag: no lag samples in the range (consumers record them every lag_interval_ms)")
        return
    print_table(console, _table("Consumer lag (end - committed offset; age of the oldest unanswered record)", [
        "model", "consumers", "lag now", "lag age now", "max lag", "max lag age",
    ], [[
        r["model"], _num(r["consumers"]), _num(r["lag_now"]), _age(r["lag_age_now_ms"]),
        _num(r["lag_max"]), _age(r["lag_age_max_ms"]),
    ] for r in s["lag_summary"]]))  # fmt: skip
    print_table(console, _table("Consumer lag per bucket", ["time", "model", "lag", "lag age"], [
        [f"{r['time']:%H:%M:%S}", r["model"], _num(r["lag"]), _age(r["lag_age_ms"])] for r in s.get("lag_over_time", [])
    ]))  # fmt: skip
