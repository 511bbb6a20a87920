"""Open-loop load: requests sent at scheduled times, whatever the consumers do.

Records due at the same instant go out as one record batch per partition
(keys hashed like Kafka's default partitioner), so the client keeps up with
10k req/s on a small machine.

A closed-loop client (send, wait for the answer, send again) slows down
exactly when the system does and hides queueing: the classic coordinated
omission. Here the send times are drawn up front (Poisson, or a scenario's
arrival process) and the sender only ever waits for the clock, so a slow
pipeline shows up as latency, not as a lower offered rate.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np
from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import murmur2

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import Topics, client_options, durable_producer
from schemas.messages import GenerationParams, Request

WORDS = (
    "river stone light batch queue window token cloud signal model request answer "
    "tail latency kafka partition engine summer market garden orbit paper music"
).split()
CHARS_PER_TOKEN = 4
"""The runners' tokenizer-free estimate; texts are built to about this many chars a token."""


@dataclass(frozen=True)
class Load:
    """Send schedule of one run: offsets from the start, what to send, where."""

    send_ms: np.ndarray
    tokens: np.ndarray
    priority: np.ndarray
    partition: np.ndarray | None = None
    """Fixed partition per request (skewed loads); None lets the key hash decide."""
    new_tokens: np.ndarray | None = None
    """Generation: max_new_tokens per request (sent as params); None sends no params."""
    timeout_ms: int | None = None
    """Deadline of every request, relative to its record time (Request.timeout_ms); None: none."""
    texts: list[str] | None = None
    """Each request's prompt; None: words drawn to about `tokens` tokens."""
    trace_index: np.ndarray | None = None
    """Each request's index in the trace it replays (Request.trace_index); None: not a trace."""
    ignore_eos: bool = False
    """Generation: every answer runs to its max_new_tokens (GenerationParams.ignore_eos)."""

    def __len__(self) -> int:
        return int(self.send_ms.shape[0])

    @property
    def duration_s(self) -> float:
        return float(self.send_ms[-1]) / 1000.0 if len(self) else 0.0


def poisson_load(rate_per_s: float, duration_s: float, seed: int, *, tokens: int = 24) -> Load:
    """Poisson arrivals at `rate_per_s` for `duration_s`; the same seed gives the same schedule."""
    rng = np.random.default_rng(seed)
    count = rng.poisson(rate_per_s * duration_s)
    send = np.sort(rng.uniform(0.0, duration_s * 1000.0, size=count))
    return Load(send, np.full(count, tokens, dtype=np.int64), np.ones(count, dtype=np.int64))


def scenario_load(path: str, multiplier: float = 1.0, partitions: int | None = None) -> Load:
    """A scenario file's arrival process; its lanes map onto partitions (hot lane 0 = partition 0)."""
    from pipeline.core.sim.arrivals import make_arrivals
    from pipeline.core.sim.scenario_file import load_scenario

    arrivals = make_arrivals(load_scenario(path), multiplier)
    lanes = arrivals.lane if partitions else None
    partition = None if lanes is None or int(lanes.max(initial=0)) == 0 else lanes % partitions
    return Load(arrivals.create_ms, arrivals.tokens, arrivals.priority, partition)


def request_text(rng: np.random.Generator, tokens: int) -> str:
    words = rng.choice(len(WORDS), size=max(1, (tokens * CHARS_PER_TOKEN) // 6))
    return " ".join(WORDS[i] for i in words)


@dataclass
class SendReport:
    sent: int
    elapsed_s: float
    late_ms_p99: float
    """How far behind schedule sends went (a loaded client machine shows here)."""

    @property
    def achieved_rate(self) -> float:
        return self.sent / self.elapsed_s if self.elapsed_s > 0 else 0.0


class LoadProducer:
    """Sends a `Load` of requests for one model, open loop, recording each send time."""

    def __init__(self, settings: KafkaSettings, model: str, *, run_id: str | None = None, seed: int = 0) -> None:
        self.settings = settings
        self.model = model
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.topic = Topics(settings.topic_prefix).requests(model)
        self.sent_ms: dict[str, float] = {}
        """Request id -> wall-clock epoch ms it was handed to the producer."""
        self._seed = seed
        self._producer: AIOKafkaProducer | None = None

    def request_id(self, index: int, tag: str = "") -> str:
        return f"{self.run_id}-{tag}{index}"

    async def __aenter__(self) -> LoadProducer:
        self._producer = AIOKafkaProducer(
            **client_options(self.settings), **durable_producer(), linger_ms=0, max_batch_size=256 * 1024
        )
        await self._producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._producer is not None:
            await self._producer.stop()

    def payloads(self, load: Load, tag: str = "", *, warmup: bool = False) -> list[bytes]:
        """Encode every request before the clock starts, so sending is cheap. Each request
        gets its own text (words drawn in order from one seeded stream), so batches pad
        to their longest input as real traffic does. `warmup` tags them as warm-up traffic."""
        rng = np.random.default_rng(self._seed)
        encode = msgspec.json.Encoder().encode
        new = load.new_tokens.tolist() if load.new_tokens is not None else [None] * len(load)
        traced = load.trace_index.tolist() if load.trace_index is not None else [None] * len(load)
        return [
            encode(
                Request(
                    id=self.request_id(i, tag),
                    model=self.model,
                    text=load.texts[i] if load.texts is not None else request_text(rng, int(t)),
                    priority=int(p),
                    params=None if n is None else GenerationParams(max_new_tokens=int(n), ignore_eos=load.ignore_eos),
                    timeout_ms=load.timeout_ms,
                    warmup=warmup,
                    trace_index=traced[i],
                )
            )
            for i, (t, p, n) in enumerate(zip(load.tokens, load.priority, new, strict=True))
        ]

    async def send(
        self, load: Load, on_progress: Callable[[int], None] | None = None, *, tag: str = "", warmup: bool = False
    ) -> SendReport:
        """Send `load` on schedule; request ids are `<run_id>-<tag><index>`."""
        producer = self._producer
        assert producer is not None, "use `async with LoadProducer(...)`"
        payloads = self.payloads(load, tag, warmup=warmup)
        schedule = load.send_ms.tolist()
        partitions = load.partition.tolist() if load.partition is not None else None
        futures: list[asyncio.Future[object]] = []
        lateness: list[float] = []
        partition_ids = sorted(await producer.partitions_for(self.topic))
        start = time.time() * 1000.0
        index = 0
        total = len(payloads)
        while index < total:
            now = time.time() * 1000.0
            due = start + schedule[index]
            if due > now:
                await asyncio.sleep((due - now) / 1000.0)
                continue
            chunk: dict[int, list[tuple[bytes, bytes]]] = {}
            while index < total and start + schedule[index] <= now:
                rid = self.request_id(index, tag)
                key = rid.encode()
                lateness.append(now - (start + schedule[index]))
                self.sent_ms[rid] = now
                if partitions is not None:
                    partition = partitions[index]
                else:
                    partition = partition_ids[(murmur2(key) & 0x7FFFFFFF) % len(partition_ids)]
                chunk.setdefault(partition, []).append((key, payloads[index]))
                index += 1
            futures.extend(await self._send_chunk(chunk, int(now)))
            if on_progress is not None:
                on_progress(index)
        await asyncio.gather(*futures)
        elapsed = (time.time() * 1000.0 - start) / 1000.0
        late = float(np.percentile(lateness, 99)) if lateness else 0.0
        return SendReport(total, max(elapsed, load.duration_s, 1e-9), late)

    async def _send_chunk(
        self, chunk: dict[int, list[tuple[bytes, bytes]]], timestamp_ms: int
    ) -> list[asyncio.Future[object]]:
        """Everything due at one instant: one record batch per partition (per-record sends cost too much at 10k/s)."""
        producer = self._producer
        assert producer is not None
        futures = []
        for partition, records in chunk.items():
            batch = producer.create_batch()
            for key, value in records:
                if batch.append(key=key, value=value, timestamp=timestamp_ms) is None:
                    futures.append(await producer.send_batch(batch, self.topic, partition=partition))
                    batch = producer.create_batch()
                    batch.append(key=key, value=value, timestamp=timestamp_ms)
            futures.append(await producer.send_batch(batch, self.topic, partition=partition))
        return futures
