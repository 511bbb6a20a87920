"""CLI command: `batchtide status`, the live view an on-call engineer looks at first.

Straight from Kafka, not from ClickHouse (which trails by the sink's insert
interval): per model, the consumer group's state and members with their
partitions, every request partition's lag and lag age (consumers/lag.py),
and each consumer's latest lag event: the engine's window, learned cap,
marked share, queue and the time of its last batch; each member's measured
capacity and its share of the group's partitions and of the requests arriving
(so one slow or overloaded member stands out); and how many events the sink has
not stored in ClickHouse yet.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import typer

from schemas.messages import LagEvent, PartitionLag

FRESH_INTERVALS = 3
"""A consumer's lag event counts as live for this many lag intervals."""


@dataclass
class ModelStatus:
    model: str
    group: str
    state: str
    members: list[dict[str, Any]]
    partitions: list[PartitionLag]
    owners: dict[str, str]
    """`topic:partition` -> client id of the member that holds it."""
    consumers: dict[str, LagEvent]
    share: bool = False
    """A share group: partitions are shared, `committed_offset` is the share-partition start offset."""

    def balance(self) -> dict[str, dict[str, float | None]]:
        """Per member: measured capacity (None before it has measured one), its share of the group's
        assigned partitions, and its share of the requests arriving (from the members' latest lag events)."""
        assigned = sum(len(m["partitions"]) for m in self.members)
        rates = {m["client_id"]: self.consumers[m["client_id"]].arrival_rate_per_s
                 for m in self.members if m["client_id"] in self.consumers}  # fmt: skip
        total_rate = sum(rates.values())
        out: dict[str, dict[str, float | None]] = {}
        for m in self.members:
            event = self.consumers.get(m["client_id"])
            out[m["client_id"]] = {
                "capacity_per_s": event.capacity_per_s if event is not None and event.capacity_per_s > 0 else None,
                "partition_share": len(m["partitions"]) / assigned if assigned else None,
                "arrival_rate_per_s": rates.get(m["client_id"]),
                "arrival_share": rates[m["client_id"]] / total_rate if total_rate and m["client_id"] in rates else None,
            }
        return out

    @property
    def total_lag(self) -> int:
        return sum(p.lag for p in self.partitions)

    @property
    def max_lag_age_ms(self) -> float:
        return max((p.lag_age_ms for p in self.partitions), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "group": self.group,
            "state": self.state,
            "group_type": "share" if self.share else "consumer",
            "members": [{**m, **self.balance()[m["client_id"]]} for m in self.members],
            "total_lag": self.total_lag,
            "max_lag_age_ms": self.max_lag_age_ms,
            "partitions": [
                {**msgspec.to_builtins(p), "owner": self.owners.get(f"{p.topic}:{p.partition}")}
                for p in self.partitions
            ],
            "consumers": {cid: msgspec.to_builtins(e) for cid, e in sorted(self.consumers.items())},
        }


@dataclass
class SinkStatus:
    """The sink's consumer group on the events topics: events not yet stored in ClickHouse."""

    group: str
    state: str
    members: int
    lag: int

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "state": self.state, "members": self.members, "lag": self.lag}


async def collect_sink(config: Any) -> SinkStatus:
    from consumers.lag import LagProbe
    from pipeline.core.kafka.client import Topics

    topics = Topics(config.kafka.topic_prefix)
    group_id = f"{config.kafka.topic_prefix}-sink"
    async with LagProbe(config.kafka) as probe:
        group = await probe.describe_group(group_id)
        events = await probe.topic_partitions([topics.latency_events, topics.batch_events, topics.lag_events])
        lags = await probe.measure(group_id, events)
    return SinkStatus(group_id, group.state, len(group.members), sum(p.lag for p in lags))


async def collect(config: Any, models: list[str]) -> list[ModelStatus]:
    from consumers.lag import LagProbe, latest_lag_events
    from pipeline.core.kafka.client import Topics

    topics = Topics(config.kafka.topic_prefix)
    fresh_ms = max(config.consumer.lag_interval_ms, 1000.0) * FRESH_INTERVALS
    events = await latest_lag_events(config.kafka, fresh_ms)
    share = config.consumer.group_type == "share"
    out = []
    async with LagProbe(config.kafka) as probe:
        for model in models:
            group_id = topics.share_group(model) if share else topics.group(model)
            group = await probe.describe(group_id, share=share)
            partitions = await probe.topic_partitions([topics.requests(model), topics.priority(model)])
            lags = await probe.lag(group_id, partitions, share=share)
            members = _members(group.members, share)
            owners = {p: m["client_id"] for m in members for p in m["partitions"]}
            mine = {cid: e for cid, e in events.items() if e.model == model}
            out.append(ModelStatus(model, group_id, group.state, members, lags, owners, mine, share))
    return out


def _members(found: Any, share: bool) -> list[dict[str, Any]]:
    """One entry per consumer: a share-mode consumer's members (`<consumer id>#<role>`) are folded
    into it, with every partition any of them was assigned (a share group's partitions are shared:
    several consumers list the same one)."""
    from pipeline.core.kafka.share_client import consumer_of

    by_consumer: dict[str, dict[str, Any]] = {}
    for m in found:
        cid = consumer_of(m.client_id) if share else m.client_id
        entry = by_consumer.setdefault(cid, {"client_id": cid, "host": m.host.lstrip("/"), "partitions": []})
        entry["partitions"] += [f"{tp.topic}:{tp.partition}" for tp in m.partitions]
    for entry in by_consumer.values():
        entry["partitions"] = sorted(set(entry["partitions"]))
    return list(by_consumer.values())


def _age(ms: float) -> str:
    if ms < 1000:
        return f"{ms:.0f} ms"
    if ms < 120_000:
        return f"{ms / 1000:.1f} s"
    return f"{ms / 60_000:.1f} min"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def balance_lines(s: ModelStatus) -> list[str]:
    """The members side by side: capacity and shares, so an unequal split is seen at once."""
    if not s.members:
        return []
    balance = s.balance()
    width = max(len("member"), *(len(cid) for cid in balance))
    lines = [f"  {'member':<{width}}  {'capacity/s':>10}  {'partitions':>10}  {'req/s':>7}  {'req share':>9}"]
    for cid, b in balance.items():
        capacity = "not yet" if b["capacity_per_s"] is None else f"{b['capacity_per_s']:,.0f}"
        rate = "-" if b["arrival_rate_per_s"] is None else f"{b['arrival_rate_per_s']:,.1f}"
        lines.append(
            f"  {cid:<{width}}  {capacity:>10}  {_share(b['partition_share']):>10}  {rate:>7}  "
            f"{_share(b['arrival_share']):>9}"
        )
    return lines


def render(statuses: list[ModelStatus], now_ms: float, sink: SinkStatus | None = None) -> str:
    lines: list[str] = []
    if sink is not None:
        lines.append(
            f"sink group {sink.group}  state {sink.state}  members {sink.members}  "
            f"events not yet in ClickHouse {sink.lag}"
        )
    for s in statuses:
        lines.append(
            f"model {s.model}  group {s.group}  state {s.state}  members {len(s.members)}  "
            f"lag {s.total_lag}  max lag age {_age(s.max_lag_age_ms)}"
        )
        lines.extend(balance_lines(s))
        for m in s.members:
            lines.append(
                f"  member {m['client_id']} ({m['host']}): {len(m['partitions'])} partitions  {' '.join(m['partitions'])}"
            )
            event = s.consumers.get(m["client_id"])
            if event is None:
                lines.append("    no lag event yet (recorded every [consumer] lag_interval_ms)")
                continue
            last = f"{_age(now_ms - event.last_batch_ms)} ago" if event.last_batch_ms else "none yet"
            lines.append(
                f"    engine: window {event.window_ms:.1f} ms, learned cap {event.effective_cap} ({event.cap_reason}), "
                f"marked {event.marked_share * 100:.1f}%, queue {event.queue}, in flight {event.inflight}, "
                f"{event.arrival_rate_per_s:.1f} req/s; last batch {last}; batches {event.batches}, "
                f"dead letters {event.dead_letters}, capacity "
                f"{f'{event.capacity_per_s:,.0f} req/s' if event.capacity_per_s > 0 else 'not measured yet'}  "
                f"(event {_age(now_ms - event.ts_ms)} old)"
            )
        gone = sorted(set(s.consumers) - {m["client_id"] for m in s.members})
        for cid in gone:
            lines.append(f"  consumer {cid}: sent lag events recently but is not a member now")
        width = max((len(f"{p.topic}:{p.partition}") for p in s.partitions), default=10)
        if s.share:
            lines.append(
                "  share group: lag = records not acknowledged from the start offset on (the broker's count); "
                "it does not say how many of them are in flight"
            )
        head, owner = ("start", "shared by") if s.share else ("committed", "owner")
        lines.append(f"  {'partition':<{width}}  {'end':>9}  {head:>9}  {'lag':>7}  {'lag age':>9}  {owner}")
        for p in s.partitions:
            name = f"{p.topic}:{p.partition}"
            committed = str(p.committed_offset) if p.committed_offset >= 0 else "-"
            holders = [m["client_id"] for m in s.members if name in m["partitions"]]
            held = (", ".join(holders) or "(nobody)") if s.share else s.owners.get(name, "(unassigned)")
            lines.append(
                f"  {name:<{width}}  {p.end_offset:>9}  {committed:>9}  {p.lag:>7}  {_age(p.lag_age_ms):>9}  {held}"
            )
    return "\n".join(lines)


def status(
    config: Path | None = typer.Option(None, "--config", help="TOML config file."),
    model: list[str] | None = typer.Option(
        None, "--model", "-m", help="Only this model (repeatable); default every configured model."
    ),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Live view from Kafka: group members and their partitions, each member's measured capacity and
    share of partitions and requests, lag and lag age per partition, each consumer's latest engine
    state (window, learned cap, marked share, last batch), and the sink's backlog of events not yet
    in ClickHouse."""
    from aiokafka.errors import KafkaError

    from pipeline.core.config import ConfigError, load_config

    try:
        cfg = load_config(config)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    models = list(model) if model else sorted(cfg.models)
    if not models:
        typer.echo("error: no models configured (add a [models.NAME] table or pass --model)", err=True)
        raise typer.Exit(2)

    async def gather() -> tuple[list[ModelStatus], SinkStatus]:
        return await collect(cfg, models), await collect_sink(cfg)

    try:
        statuses, sink = asyncio.run(gather())
    except KafkaError as e:
        typer.echo(f"error: Kafka at {cfg.kafka.bootstrap_servers}: {e!r}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps({"sink": sink.to_dict(), "models": [s.to_dict() for s in statuses]}, indent=2))
    else:
        typer.echo(render(statuses, time.time() * 1000, sink))


def register(app: typer.Typer) -> None:
    app.command("status")(status)
