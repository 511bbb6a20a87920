"""The synthetic data generator: deterministic, exact row counts, internally consistent."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.core.store import seed
from pipeline.core.store.seed import batch_events, generate, latency_events

START_MS = 1_796_000_000_000


def _chunks(rows: int, seed: int) -> list:
    return list(generate(rows, seed=seed, start_ms=START_MS, duration_ms=600_000))


def test_same_arguments_same_rows_other_seed_other_rows() -> None:
    a, b, c = _chunks(30_000, 5), _chunks(30_000, 5), _chunks(30_000, 6)
    assert [x.latency["request_id"] for x in a] == [x.latency["request_id"] for x in b]
    assert all(np.array_equal(x.latency["wait_ms"], y.latency["wait_ms"]) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x.latency["wait_ms"], y.latency["wait_ms"]) for x, y in zip(a, c, strict=True))


def test_rows_and_batches_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seed, "CHUNK_ROWS", 5_000)
    chunks = list(generate(24_001, seed=1, start_ms=START_MS, duration_ms=3_600_000))
    assert sum(c.rows for c in chunks) == 24_001
    assert len(chunks) > 2, "large requests are generated in chunks"
    for c in chunks:
        lat, bat = c.latency, c.batches
        assert int(np.sum(bat["size"])) == c.rows
        assert np.all(bat["size"] >= 1) and np.all(bat["size"] <= 48)
        enqueue = np.array(lat["enqueue_time"])
        assert np.array_equal(np.array(lat["produce_time"]) - enqueue, lat["e2e_ms"].astype(np.int64))
        assert np.array_equal(np.array(lat["dispatch_time"]) - enqueue, lat["wait_ms"].astype(np.int64))
        assert enqueue.min() >= START_MS - 60_000 and enqueue.max() < START_MS + 3_600_000
        assert len(set(lat["request_id"])) == c.rows


def test_wire_events_round_trip_the_columns() -> None:
    chunk = _chunks(500, 2)[0]
    events, batches = latency_events(chunk), batch_events(chunk)
    assert len(events) == chunk.rows and len(batches) == len(chunk.batches["batch_id"])
    assert events[10].request_id == chunk.latency["request_id"][10]
    assert events[10].wait_ms == float(chunk.latency["wait_ms"][10])
    assert sum(b.size for b in batches) == chunk.rows
