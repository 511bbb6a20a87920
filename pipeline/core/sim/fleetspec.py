"""A scenario's `[fleet]` table: one model's consumer group as Kafka lays it out.

The request topic has `partitions`; Kafka's range assignor gives each of the
`[topology] consumers` a contiguous block of equal count (the first ones one
more when it does not divide), and the priority topic, with the same count,
the same blocks. Keys hash evenly, or one hot partition carries a share of
them. Devices differ: some consumers are steadily slower (`slow`), one may
slow down for a while (`slowdown`). Forwarding follows
pipeline/core/engine/peer_forwarding.py with beacons every `beacon_interval_ms` and one
Kafka hop of `hop_ms` for a forward and for a beacon. Documented in
docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

DEFAULT_BEACON_INTERVAL_MS = 100.0
"""How often a consumer publishes its beacon (MemberView): `[consumer] fleet_beacon_ms`."""
DEFAULT_HOP_MS = 10.0
"""One Kafka hop: produce, then the peer's fetch (ForwardRule.hop_ms's default)."""
DEFAULT_SCAN_INTERVAL_MS = 20.0
"""How often a consumer plans forwards over its queue (the live consumer's scan interval)."""


@dataclass(frozen=True)
class Slow:
    """Consumers whose device takes `factor` x t(b) for the whole run."""

    consumers: tuple[int, ...]
    factor: float


@dataclass(frozen=True)
class Slowdown:
    """One consumer's device takes `factor` x t(b) for batches started in [from_ms, to_ms)."""

    consumer: int
    from_ms: float
    to_ms: float
    factor: float


@dataclass(frozen=True)
class FleetSpec:
    partitions: int
    slow: tuple[Slow, ...] = ()
    slowdowns: tuple[Slowdown, ...] = ()
    hot_partition: int = 0
    hot_share: float = 0.0
    """Share of the keys on `hot_partition`; 0: every partition gets an equal share."""
    forwarding: bool = True
    beacon_interval_ms: float = DEFAULT_BEACON_INTERVAL_MS
    hop_ms: float = DEFAULT_HOP_MS
    scan_interval_ms: float = DEFAULT_SCAN_INTERVAL_MS
    assignment: str = "range"
    """range: Kafka's range assignor (equal counts); capacity: counts in proportion to each device's
    steady speed, as a capacity-weighted assignor would reach once it knew every device."""

    def owned(self, consumers: int) -> list[tuple[int, ...]]:
        """Partitions of each consumer under this spec's assignment."""
        if self.assignment == "capacity":
            return weighted_assignment(self.partitions, [1.0 / self.steady_factor(c) for c in range(consumers)])
        return range_assignment(self.partitions, consumers)

    def steady_factor(self, consumer: int) -> float:
        """The consumer's device speed outside any slowdown (what its profile measured)."""
        factor = 1.0
        for s in self.slow:
            if consumer in s.consumers:
                factor *= s.factor
        return factor

    def factor(self, consumer: int, now_ms: float) -> float:
        """t(b) multiplier of a batch the consumer starts at `now_ms`."""
        factor = self.steady_factor(consumer)
        for w in self.slowdowns:
            if w.consumer == consumer and w.from_ms <= now_ms < w.to_ms:
                factor *= w.factor
        return factor

    def partition_weights(self) -> np.ndarray:
        """Share of the keys per partition."""
        if self.hot_share <= 0 or self.partitions == 1:
            return np.full(self.partitions, 1.0 / self.partitions)
        weights = np.full(self.partitions, (1.0 - self.hot_share) / (self.partitions - 1))
        weights[self.hot_partition] = self.hot_share
        return weights

    def ideal(self) -> FleetSpec:
        """The group as it should be: every device fast, keys spread evenly, no forwarding."""
        return replace(self, slow=(), slowdowns=(), hot_share=0.0, forwarding=False, assignment="range")


def range_assignment(partitions: int, consumers: int) -> list[tuple[int, ...]]:
    """Kafka's range assignor for one topic: consumer i (members in id order) gets a contiguous
    block; the first `partitions % consumers` get one partition more."""
    base, extra = divmod(partitions, consumers)
    out = []
    start = 0
    for i in range(consumers):
        count = base + (1 if i < extra else 0)
        out.append(tuple(range(start, start + count)))
        start += count
    return out


def weighted_assignment(partitions: int, weights: list[float]) -> list[tuple[int, ...]]:
    """Contiguous blocks sized in proportion to `weights` (largest remainder), at least one each."""
    total = sum(weights)
    exact = [partitions * w / total for w in weights]
    counts = [max(1, int(e)) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder:
        if sum(counts) >= partitions:
            break
        counts[i] += 1
    while sum(counts) > partitions:
        counts[max(range(len(counts)), key=lambda i: counts[i] - exact[i])] -= 1
    out, start = [], 0
    for count in counts:
        out.append(tuple(range(start, start + count)))
        start += count
    return out


def partition_owner(fleet: FleetSpec, consumers: int) -> np.ndarray:
    """Consumer index owning each partition under the spec's assignment."""
    owner = np.zeros(fleet.partitions, dtype=np.int64)
    for consumer, block in enumerate(fleet.owned(consumers)):
        owner[list(block)] = consumer
    return owner


# ---- loading and validation ------------------------------------------------------------


def parse_fleet(raw: Any, where: str, consumers: int, duration_ms: float, error: type[Exception]) -> FleetSpec:
    """A `[fleet]` table for a group of `consumers`; `error(message)` names the key at fault."""
    known = {
        "partitions",
        "assignment",
        "slow",
        "slowdown",
        "hot",
        "forwarding",
        "beacon_interval_ms",
        "hop_ms",
        "scan_interval_ms",
    }
    _table(where, raw, known, error)
    if "partitions" not in raw:
        raise error(f"{where}: missing key 'partitions' (partitions of the request topic)")
    partitions = _whole(where, raw, "partitions", error)
    if partitions < consumers:
        raise error(
            f"{where}.partitions: {partitions} partitions for {consumers} consumers: the range "
            f"assignor would leave {consumers - partitions} consumer(s) without work"
        )
    assignment = raw.get("assignment", "range")
    if assignment not in ("range", "capacity"):
        raise error(
            f"{where}.assignment: {assignment!r} is not one of ['range', 'capacity'] (Kafka's range "
            "assignor, or partition counts in proportion to each device's speed)"
        )

    def consumer_index(w: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < consumers:
            raise error(f"{w}: {value!r} is not a consumer index 0..{consumers - 1}")
        return value

    slow = []
    for i, t in enumerate(_tables(raw.get("slow", []), f"{where}.slow", error)):
        w = f"{where}.slow" if isinstance(raw.get("slow"), dict) else f"{where}.slow[{i}]"
        _table(w, t, {"consumers", "factor"}, error)
        listed = t.get("consumers")
        if not isinstance(listed, list) or not listed:
            raise error(f"{w}.consumers: expected a non-empty list of consumer indexes, got {listed!r}")
        idx = tuple(consumer_index(f"{w}.consumers", c) for c in listed)
        if len(set(idx)) != len(idx):
            raise error(f"{w}.consumers: a consumer is listed twice")
        slow.append(Slow(idx, _positive(w, t, "factor", error)))

    slowdowns = []
    for i, t in enumerate(_tables(raw.get("slowdown", []), f"{where}.slowdown", error)):
        w = f"{where}.slowdown" if isinstance(raw.get("slowdown"), dict) else f"{where}.slowdown[{i}]"
        _table(w, t, {"consumer", "from_s", "to_s", "factor"}, error)
        if "consumer" not in t:
            raise error(f"{w}: missing key 'consumer'")
        consumer = consumer_index(f"{w}.consumer", t["consumer"])
        start, end = _nonneg(w, t, "from_s", error), _nonneg(w, t, "to_s", error)
        if end <= start:
            raise error(f"{w}: to_s ({end:g}) must be after from_s ({start:g})")
        if start * 1000.0 >= duration_ms:
            raise error(f"{w}.from_s: {start:g} s is past the end of the run ({duration_ms / 1000.0:g} s)")
        slowdowns.append(Slowdown(consumer, start * 1000.0, end * 1000.0, _positive(w, t, "factor", error)))

    hot_partition, hot_share = 0, 0.0
    if "hot" in raw:
        w = f"{where}.hot"
        _table(w, raw["hot"], {"partition", "share"}, error)
        hot = raw["hot"]
        hot_partition = _whole(w, hot, "partition", error, minimum=0) if "partition" in hot else 0
        if hot_partition >= partitions:
            raise error(f"{w}.partition: {hot_partition} is not a partition 0..{partitions - 1}")
        hot_share = _positive(w, hot, "share", error)
        if not hot_share < 1.0 or partitions == 1:
            raise error(f"{w}.share: must be > 0 and < 1 with at least two partitions (got {hot_share:g})")

    forwarding = raw.get("forwarding", True)
    if not isinstance(forwarding, bool):
        raise error(f"{where}.forwarding: expected true or false, got {forwarding!r}")
    beacon = _positive(where, raw, "beacon_interval_ms", error, DEFAULT_BEACON_INTERVAL_MS)
    hop = _nonneg(where, raw, "hop_ms", error, DEFAULT_HOP_MS)
    scan = _positive(where, raw, "scan_interval_ms", error, DEFAULT_SCAN_INTERVAL_MS)
    return FleetSpec(
        partitions, tuple(slow), tuple(slowdowns), hot_partition, hot_share, forwarding, beacon, hop, scan, assignment
    )


def _table(where: str, t: Any, known: set[str], error: type[Exception]) -> None:
    if not isinstance(t, dict):
        raise error(f"{where}: expected a table, got {t!r}")
    for key in t:
        if key not in known:
            raise error(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")


def _tables(value: Any, where: str, error: type[Exception]) -> list[Any]:
    """One table or a list of them."""
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list):
        return value
    raise error(f"{where}: expected a table or a list of tables, got {value!r}")


def _number(where: str, t: dict[str, Any], key: str, error: type[Exception], default: float | None) -> float:
    if key not in t:
        if default is None:
            raise error(f"{where}: missing key {key!r}")
        return default
    v = t[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise error(f"{where}.{key}: expected a number, got {v!r}")
    return float(v)


def _positive(where: str, t: dict[str, Any], key: str, error: type[Exception], default: float | None = None) -> float:
    v = _number(where, t, key, error, default)
    if v <= 0:
        raise error(f"{where}.{key}: must be > 0 (got {v:g})")
    return v


def _nonneg(where: str, t: dict[str, Any], key: str, error: type[Exception], default: float | None = None) -> float:
    v = _number(where, t, key, error, default)
    if v < 0:
        raise error(f"{where}.{key}: must be >= 0 (got {v:g})")
    return v


def _whole(where: str, t: dict[str, Any], key: str, error: type[Exception], minimum: int = 1) -> int:
    v = t.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise error(f"{where}.{key}: expected a whole number >= {minimum}, got {v!r}")
    return v
