"""Reading the pipeline's answers back: the results topic (and the dead letters and latency events
beside it), followed from the start while a run goes on, or read once until enough is there.

`ResultArrivals` stamps each answer on the client's clock (the benches' latency);
`Collector` hands every answer, dead letter and event to a ledger (the fault
scenarios' accounting); `read_results` reads outcomes once (the demo).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import msgspec

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import Topics
from pipeline.core.kafka.first_answers import FirstAnswers
from pipeline.core.kafka.reader import Record, TopicReader
from schemas.messages import DeadLetter, LatencyEvent, Result


class Follower:
    """Reads topics from their start in the background, handing each record to `on_record`;
    the reader rides out broker restarts, and its failure surfaces in `wait_until`."""

    def __init__(
        self,
        settings: KafkaSettings,
        topics: list[str],
        on_record: Callable[[Record], None],
        *,
        poll_ms: int,
        request_timeout_ms: int | None = None,
    ) -> None:
        extra: dict[str, Any] = {} if request_timeout_ms is None else {"request_timeout_ms": request_timeout_ms}
        self._reader = TopicReader(settings, topics, **extra)
        self._on_record = on_record
        self._poll_ms = poll_ms
        self._task: asyncio.Task[bool] | None = None

    async def start(self) -> None:
        await self._reader.start()
        self._task = asyncio.create_task(self._reader.read(self._on_record, poll_ms=self._poll_ms))

    async def wait_until(self, done: Callable[[], bool], timeout_s: float, poll_s: float) -> bool:
        """Whether `done()` turned true within `timeout_s` (raises what stopped the reader)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._task is not None and self._task.done():
                self._task.result()
            if done():
                return True
            await asyncio.sleep(poll_s)
        return done()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self._reader.stop()


class ResultArrivals(Follower):
    """The results topic of one model, each answer's first arrival stamped on the client's clock.

    Only the outcome and the consumer id are taken from the value, by pattern:
    decoding every Result would cost the client time at the benches' top rates.
    """

    OUTCOME = re.compile(rb'"outcome":"([a-z]+)"')
    CONSUMER = re.compile(rb'"consumer_id":"([^"]*)"')

    def __init__(self, settings: KafkaSettings, model: str) -> None:
        super().__init__(settings, [Topics(settings.topic_prefix).results(model)], self._stamp, poll_ms=50)
        self.received_ms: dict[str, float] = {}
        self.outcomes: dict[str, str] = {}
        self.consumers: dict[str, str] = {}
        self.repeats: dict[str, int] = {}
        """Answers that arrived again after the first, by request id (exactly once: none)."""
        self._first = FirstAnswers()
        self.repeats_past_dedup = 0
        """Of those, answers a `FirstAnswers` reader would still hand out (its window passed)."""

    def _stamp(self, record: Record) -> None:
        key = record.key.decode() if record.key else ""
        first = self._first.first(key, record.timestamp)
        if key in self.received_ms:
            self.repeats[key] = self.repeats.get(key, 0) + 1
            self.repeats_past_dedup += first
        else:
            self.received_ms[key] = time.time() * 1000.0
            found = self.OUTCOME.search(record.value or b"")
            self.outcomes[key] = found.group(1).decode() if found else "undecodable"
            by = self.CONSUMER.search(record.value or b"")
            self.consumers[key] = by.group(1).decode() if by else ""

    async def wait_for(self, ids: list[str], timeout_s: float) -> bool:
        return await self.wait_until(lambda: all(i in self.received_ms for i in ids), timeout_s, 0.05)

    async def drain(self, ids: list[str], idle_s: float, most_s: float) -> float:
        """Wait until every id is answered, while answers keep coming (none for `idle_s`: the
        consumer stalled) and at most `most_s`; returns the seconds waited."""
        started = last = time.monotonic()
        seen = len(self.received_ms)
        while any(i not in self.received_ms for i in ids):
            now = time.monotonic()
            if len(self.received_ms) != seen:
                seen, last = len(self.received_ms), now
            if now - last >= idle_s or now - started >= most_s:
                break
            await asyncio.sleep(0.2)
        return time.monotonic() - started


class Accounts(Protocol):
    """What a `Collector` hands its records to (the chaos ledger)."""

    def record_result(self, result: Result, at: float) -> None: ...
    def record_timing(self, event: LatencyEvent) -> None: ...
    def record_dead(self, letter: DeadLetter, at: float) -> None: ...
    def unanswered(self, ids: Iterable[str] | None = None) -> list[str]: ...


class Collector(Follower):
    """The results and DLQ topics (and optionally the latency events) of one model, decoded into
    `accounts` with the wall-clock time each arrived."""

    def __init__(
        self, settings: KafkaSettings, model: str, accounts: Accounts, *, latency_events: bool = False
    ) -> None:
        topics = Topics(settings.topic_prefix)
        self._results_topic = topics.results(model)
        self._latency_topic = topics.latency_events
        names = [self._results_topic, topics.dlq, *([self._latency_topic] if latency_events else [])]
        super().__init__(settings, names, self._record, poll_ms=200, request_timeout_ms=30_000)
        self._accounts = accounts
        self._result_decoder = msgspec.json.Decoder(Result)
        self._dead_decoder = msgspec.json.Decoder(DeadLetter)
        self._latency_decoder = msgspec.json.Decoder(LatencyEvent)

    def _record(self, record: Record) -> None:
        if record.value is None:
            return
        if record.topic == self._results_topic:
            self._accounts.record_result(self._result_decoder.decode(record.value), time.time())
        elif record.topic == self._latency_topic:
            self._accounts.record_timing(self._latency_decoder.decode(record.value))
        else:
            self._accounts.record_dead(self._dead_decoder.decode(record.value), time.time())

    async def wait_answered(self, ids: Iterable[str], timeout_s: float) -> bool:
        wanted = list(ids)
        return await self.wait_until(lambda: not self._accounts.unanswered(wanted), timeout_s, 0.1)


async def read_results(
    settings: KafkaSettings, model: str, enough: Callable[[dict[str, tuple[str, str | None]]], bool], timeout_s: float
) -> dict[str, tuple[str, str | None]]:
    """(outcome, error) per request id on the model's results topic, read once until `enough` says so."""
    outcomes: dict[str, tuple[str, str | None]] = {}
    decode = msgspec.json.Decoder(Result).decode

    def add(record: Any) -> None:
        result = decode(record.value)
        outcomes.setdefault(result.id, (result.outcome, result.error))

    async with TopicReader(settings, Topics(settings.topic_prefix).results(model)) as reader:
        await reader.read(add, until=lambda: enough(outcomes), timeout_s=timeout_s)
    return outcomes
