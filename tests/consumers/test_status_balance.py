"""`batchtide status` puts the members of a group side by side: measured capacity, share of the
group's partitions and of the requests arriving, from what the group description and each member's
latest lag event say (the live path is covered in test_lag.py against the real broker)."""

from __future__ import annotations

from pipeline.tools.commands.status import ModelStatus, render
from schemas.messages import LagEvent, PartitionLag


def _event(consumer: str, capacity: float, rate: float) -> LagEvent:
    return LagEvent(
        ts_ms=1_000, model="m", consumer_id=consumer, group="g", partitions=[], queue=0, inflight=0, window_ms=5.0,
        effective_cap=32, cap_reason="knee", marked_share=0.0, arrival_rate_per_s=rate, batches=10,
        last_batch_ms=900, dead_letters=0, capacity_per_s=capacity,
    )  # fmt: skip


def _status(events: dict[str, LagEvent]) -> ModelStatus:
    members = [
        {"client_id": "fast", "host": "h1", "partitions": ["r:0", "r:1", "r:2", "p:0", "p:1", "p:2"]},
        {"client_id": "slow", "host": "h2", "partitions": ["r:3", "p:3"]},
        {"client_id": "new", "host": "h3", "partitions": []},
    ]
    partitions = [PartitionLag("r", p, 10, 10, 0, 0, 0.0) for p in range(4)]
    return ModelStatus("m", "g", "Stable", members, partitions, {}, events)


def test_each_member_shows_capacity_and_shares() -> None:
    status = _status({"fast": _event("fast", 460.0, 225.0), "slow": _event("slow", 0.0, 75.0)})
    balance = status.balance()
    assert balance["fast"] == {"capacity_per_s": 460.0, "partition_share": 0.75, "arrival_rate_per_s": 225.0,
                               "arrival_share": 0.75}  # fmt: skip
    assert balance["slow"]["capacity_per_s"] is None, "0 means not measured yet"
    assert balance["slow"]["partition_share"] == 0.25 and balance["slow"]["arrival_share"] == 0.25
    assert balance["new"] == {"capacity_per_s": None, "partition_share": 0.0, "arrival_rate_per_s": None,
                              "arrival_share": None}  # fmt: skip
    text = render([status], now_ms=2_000)
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if "capacity/s" in line)
    assert lines[header].split() == ["member", "capacity/s", "partitions", "req/s", "req", "share"]
    assert lines[header + 1].split() == ["fast", "460", "75%", "225.0", "75%"]
    assert lines[header + 2].split() == ["slow", "not", "yet", "25%", "75.0", "25%"]
    assert lines[header + 3].split() == ["new", "not", "yet", "0%", "-", "-"]
    assert "capacity 460 req/s" in text and "capacity not measured yet" in text
    members = status.to_dict()["members"]
    assert [m["partition_share"] for m in members] == [0.75, 0.25, 0.0]


def test_a_group_without_lag_events_still_shows_its_partition_split() -> None:
    balance = _status({}).balance()
    assert [b["partition_share"] for b in balance.values()] == [0.75, 0.25, 0.0]
    assert all(b["arrival_share"] is None and b["capacity_per_s"] is None for b in balance.values())
