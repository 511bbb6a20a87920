"""Recorded traffic of one model over a time range, read back for `batchtide replay`.

Three reads, all bounded by the range and the model (bound as parameters, never
spliced): every request that ran, as the report's latency figures count them (no
warm-up, no refusal: a refused request never reached the device), with its record
time, tokens, priority, partition, the consumer that served it and what it
measured; every batch (size, cost, compute time, dispatch time), from which the
device's t(b) and its speed moment by moment are taken; and each batch's stamps
from its answers: the gap from dispatch to the start of compute, and from the end
of compute to publishing the answers (their mean over the batch). `FINAL`
collapses the rows a redelivered event may have inserted twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from clickhouse_connect.driver.client import Client

from pipeline.core.store.identifiers import checked_identifier

REQUESTS_SQL = """
SELECT
    toUnixTimestamp64Milli(enqueue_time) AS enqueue_ms,
    toUnixTimestamp64Milli(produce_time) AS produce_ms,
    toFloat64(toUnixTimestamp64Milli(fetch_time) - toUnixTimestamp64Milli(enqueue_time)) AS fetch_lag_ms,
    toUInt32(tokens_in + tokens_out) AS tokens,
    priority,
    kafka_partition,
    consumer_id,
    outcome,
    e2e_ms,
    wait_ms,
    compute_ms,
    tail_marked,
    tokens_in,
    tokens_out,
    toUnixTimestamp64Milli(first_token_time) AS first_token_ms,
    toUnixTimestamp64Milli(last_token_time) AS last_token_ms
FROM {db}.request_latency FINAL
WHERE model = {{model:String}} AND NOT warmup AND outcome != 'rejected'
  AND enqueue_time >= fromUnixTimestamp64Milli({{time_from:Int64}}, 'UTC')
  AND enqueue_time < fromUnixTimestamp64Milli({{time_to:Int64}}, 'UTC')
ORDER BY enqueue_ms
"""

BATCHES_SQL = """
SELECT size, cost, compute_ms, consumer_id, batch_id, toUnixTimestamp64Milli(dispatch_time) AS dispatch_ms
FROM {db}.batches FINAL
WHERE model = {{model:String}}
  AND dispatch_time >= fromUnixTimestamp64Milli({{time_from:Int64}}, 'UTC')
  AND dispatch_time < fromUnixTimestamp64Milli({{time_to:Int64}}, 'UTC')
"""


STAMPS_SQL = """
SELECT
    consumer_id,
    batch_id,
    toFloat64(min(toUnixTimestamp64Milli(compute_start_time)) - min(toUnixTimestamp64Milli(dispatch_time))) AS start_gap_ms,
    avg(toFloat64(toUnixTimestamp64Milli(produce_time) - toUnixTimestamp64Milli(compute_end_time))) AS publish_gap_ms
FROM {db}.request_latency FINAL
WHERE model = {{model:String}} AND NOT warmup AND outcome = 'ok' AND batch_id > 0
  AND toUnixTimestamp64Milli(compute_start_time) > 0 AND toUnixTimestamp64Milli(compute_end_time) > 0
  AND enqueue_time >= fromUnixTimestamp64Milli({{time_from:Int64}}, 'UTC')
  AND enqueue_time < fromUnixTimestamp64Milli({{time_to:Int64}}, 'UTC')
GROUP BY consumer_id, batch_id
"""


@dataclass
class RecordedTraffic:
    """Parallel arrays, one entry per request (ordered by record time) or per batch."""

    model: str
    enqueue_ms: np.ndarray
    produce_ms: np.ndarray
    fetch_lag_ms: np.ndarray
    """Record time to fetch by the consumer: broker and fetch lag (and pauses)."""
    tokens: np.ndarray
    priority: np.ndarray
    partition: np.ndarray
    consumer: np.ndarray
    """Index into `consumers` of the consumer that answered the request."""
    consumers: list[str]
    outcome: np.ndarray
    e2e_ms: np.ndarray
    wait_ms: np.ndarray
    compute_ms: np.ndarray
    marked: np.ndarray
    batch_size: np.ndarray
    batch_cost: np.ndarray
    batch_compute_ms: np.ndarray
    batch_consumer: np.ndarray
    """Per batch: index into `consumers`, dispatch epoch ms, and the gaps from its answers'
    stamps (NaN when none of its answers was read)."""
    batch_dispatch_ms: np.ndarray
    batch_start_gap_ms: np.ndarray
    batch_publish_gap_ms: np.ndarray
    tokens_in: np.ndarray
    """Generation: prompt tokens, answer tokens and the epoch ms of the first and last token
    (0 when the model does not generate)."""
    tokens_out: np.ndarray
    first_token_ms: np.ndarray
    last_token_ms: np.ndarray

    @property
    def stamped(self) -> bool:
        """Whether the batches carry their answers' stamps (start and publish gaps)."""
        return bool((~np.isnan(self.batch_start_gap_ms)).any())

    @property
    def generating(self) -> bool:
        """Whether the window is of a generating model (its answers have first-token stamps)."""
        return bool((self.first_token_ms > 0).any())

    def __len__(self) -> int:
        return int(self.enqueue_ms.shape[0])


def read_traffic(client: Client, database: str, model: str, time_from_ms: int, time_to_ms: int) -> RecordedTraffic:
    db = checked_identifier(database)
    params = {"model": model, "time_from": int(time_from_ms), "time_to": int(time_to_ms)}
    req = client.query(REQUESTS_SQL.format(db=db), parameters=params).result_columns
    bat = client.query(BATCHES_SQL.format(db=db), parameters=params).result_columns
    if not req:
        req = [[] for _ in range(16)]
    stamps = client.query(STAMPS_SQL.format(db=db), parameters=params).result_columns
    if not bat:
        bat = [[] for _ in range(6)]
    if not stamps:
        stamps = [[] for _ in range(4)]
    names = sorted(set(req[6]) | set(bat[3]))
    index = {name: i for i, name in enumerate(names)}
    gaps = {(c, int(b)): (float(s), float(p)) for c, b, s, p in zip(*stamps, strict=True)}
    nan = (float("nan"), float("nan"))
    batch_gaps = np.asarray(
        [gaps.get((c, int(b)), nan) for c, b in zip(bat[3], bat[4], strict=True)], dtype=float
    ).reshape(-1, 2)
    return RecordedTraffic(
        model=model,
        enqueue_ms=np.asarray(req[0], dtype=float),
        produce_ms=np.asarray(req[1], dtype=float),
        fetch_lag_ms=np.maximum(np.asarray(req[2], dtype=float), 0.0),
        tokens=np.asarray(req[3], dtype=np.int64),
        priority=np.asarray(req[4], dtype=np.int64),
        partition=np.asarray(req[5], dtype=np.int64),
        consumer=np.asarray([index[c] for c in req[6]], dtype=np.int64),
        consumers=names,
        outcome=np.asarray(req[7], dtype=object),
        e2e_ms=np.asarray(req[8], dtype=float),
        wait_ms=np.asarray(req[9], dtype=float),
        compute_ms=np.asarray(req[10], dtype=float),
        marked=np.asarray(req[11], dtype=bool),
        batch_size=np.asarray(bat[0], dtype=np.int64),
        batch_cost=np.asarray(bat[1], dtype=np.int64),
        batch_compute_ms=np.asarray(bat[2], dtype=float),
        batch_consumer=np.asarray([index[c] for c in bat[3]], dtype=np.int64),
        batch_dispatch_ms=np.asarray(bat[5], dtype=float),
        batch_start_gap_ms=batch_gaps[:, 0],
        batch_publish_gap_ms=batch_gaps[:, 1],
        tokens_in=np.asarray(req[12], dtype=np.int64),
        tokens_out=np.asarray(req[13], dtype=np.int64),
        first_token_ms=np.asarray(req[14], dtype=float),
        last_token_ms=np.asarray(req[15], dtype=float),
    )
