"""Bad input as a chaos fault: a hostile corpus mixed into steady valid traffic, every record accounted for.

The corpus is what an operator meets from careless or hostile producers:
records too large for the consumer (one just under the broker's own limit),
malformed ones (truncated JSON, invalid UTF-8, NaN, a token id of -1, a
number for the model, empty and null values), requests for a model nobody
serves on this topic, reply topics into the pipeline's own topics or
Kafka's internal ones, a reply topic that does not exist, and ids already
answered. Each hostile record has an expected fate, checked by its
partition and offset, not by luck:

- a dead letter with the expected reason for that very record, or
- for a reply topic that does not exist: an `ok` answer on the model's
  results topic whose `reply_error` says why.

The promise of the row: no valid request lost or answered twice, every
hostile record accounted for, and the one consumer process never restarts.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiokafka import AIOKafkaProducer

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import Topics, client_options
from pipeline.core.kafka.reader import TopicReader
from pipeline.tools.chaos.deployment import CHAOS_MODEL, CostModelDevice, Deployment, Stage
from pipeline.tools.chaos.ledger import FaultReport
from pipeline.tools.chaos.steps import ChaosSizes, settle_answers
from schemas.messages import DeadLetter

CONSUMER_MAX_MESSAGE_BYTES = 512 * 1024
"""The consumer's own limit in this scenario, so that records the broker takes are still refused by size."""
BROKER_LIMIT_BYTES = 1_048_588
"""Kafka's default max.message.bytes: the largest record the broker accepts on a default topic."""


@dataclass(frozen=True)
class Hostile:
    """One hostile record and what must become of it."""

    kind: str
    value: bytes | None
    expect: str
    """The dead-letter reason, or `rerouted` (an ok answer on the results topic with a reply_error)."""
    request_id: str | None = None


def _json(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def _padded(request_id: str, model: str, size: int) -> bytes:
    """Valid JSON of exactly `size` bytes (a text far over the schema's limit)."""
    head = _json(id=request_id, model=model, text="")
    return head[:-2] + b"x" * (size - len(head)) + head[-2:]


def hostile_corpus(topics: Topics, model: str, tag: str, answered_id: str | None) -> list[Hostile]:
    """One round of the corpus; `tag` makes its ids unique, `answered_id` is a valid id already answered."""
    rid = f"hostile-{tag}"
    corpus = [
        Hostile("oversize (900 KB)", _padded(f"{rid}-900k", model, 900_000), "oversize"),
        Hostile("just under the broker's limit", _padded(f"{rid}-max", model, BROKER_LIMIT_BYTES - 2048), "oversize"),
        Hostile("text over the schema (400 KB)", _padded(f"{rid}-400k", model, 400_000), "schema", f"{rid}-400k"),
        Hostile("truncated JSON", _json(id=f"{rid}-trunc", model=model, text="cut")[:-9], "invalid_json"),
        Hostile(
            "invalid UTF-8",
            b'{"id":"' + rid.encode() + b'-utf","model":"' + model.encode() + b'","text":"\xff\xfe"}',
            "not_utf8",
        ),
        Hostile(
            "NaN", b'{"id":"' + rid.encode() + b'-nan","model":"' + model.encode() + b'","text":NaN}', "invalid_json"
        ),
        Hostile("model is a number", b'{"model": 1}', "schema"),
        Hostile("token id -1", _json(id=f"{rid}-tok", model=model, token_ids=[-1]), "schema", f"{rid}-tok"),
        Hostile("empty value", b"", "empty"),
        Hostile("null value", None, "empty"),
        Hostile(
            "model nobody serves",
            _json(id=f"{rid}-nobody", model="nobody", text="hi"),
            "model_mismatch",
            f"{rid}-nobody",
        ),
        Hostile(
            "reply into the pipeline",
            _json(id=f"{rid}-into", model=model, text="hi", reply_topic=topics.results("another-model")),
            "reply_topic",
            f"{rid}-into",
        ),
        Hostile(
            "reply to a Kafka internal topic",
            _json(id=f"{rid}-internal", model=model, text="hi", reply_topic="__consumer_offsets"),
            "reply_topic",
            f"{rid}-internal",
        ),
        Hostile(
            "reply topic that does not exist",
            _json(id=f"{rid}-missing", model=model, text="hi", reply_topic=f"{topics.prefix}-client.missing"),
            "rerouted",
            f"{rid}-missing",
        ),
    ]
    if answered_id is not None:
        corpus.append(
            Hostile("duplicate id", _json(id=answered_id, model=model, text="again"), "duplicate", answered_id)
        )
    return corpus


@dataclass
class Sent:
    hostile: Hostile
    partition: int
    offset: int


class HostileProducer:
    """Sends corpus records to the requests topic and remembers where each one landed."""

    def __init__(self, settings: KafkaSettings, topic: str) -> None:
        self._topic = topic
        self._producer = AIOKafkaProducer(
            acks="all", max_request_size=2 * BROKER_LIMIT_BYTES, **client_options(settings)
        )
        self.sent: list[Sent] = []

    async def start(self) -> None:
        await self._producer.start()

    async def send(self, records: list[Hostile]) -> None:
        for record in records:
            key = (record.request_id or record.kind).encode()  # a null value needs a key
            meta = await self._producer.send_and_wait(self._topic, record.value, key=key)
            self.sent.append(Sent(record, meta.partition, meta.offset))

    async def stop(self) -> None:
        await self._producer.stop()


async def read_all(settings: KafkaSettings, topic: str, timeout_s: float = 30.0) -> list[bytes]:
    """Every committed record value of `topic` up to its end offsets now."""
    values: list[bytes] = []
    async with TopicReader(settings, topic) as reader:
        await reader.read_to_end(lambda r: values.append(r.value) if r.value is not None else None, timeout_s=timeout_s)
    return values


@dataclass
class Accounting:
    """What became of each hostile record."""

    accounted: int = 0
    dead_lettered: int = 0
    rejected_answers: int = 0
    rerouted: int = 0
    unaccounted: list[str] = field(default_factory=list)
    truncated_letters: int = 0


def account(sent: list[Sent], topic: str, letters: list[DeadLetter], results: dict[str, list[Any]]) -> Accounting:
    """Match every hostile record to its dead letter (by partition and offset) or its rerouted answer."""
    by_place = {(letter.topic, letter.partition, letter.offset): letter for letter in letters}
    out = Accounting()
    for item in sent:
        hostile = item.hostile
        if hostile.expect == "rerouted":
            answers = results.get(hostile.request_id or "", [])
            if (
                answers
                and answers[0].get("outcome") == "ok"
                and "does not exist" in (answers[0].get("reply_error") or "")
            ):
                out.accounted += 1
                out.rerouted += 1
            else:
                out.unaccounted.append(f"{hostile.kind}: no rerouted answer")
            continue
        letter = by_place.get((topic, item.partition, item.offset))
        if letter is None or letter.reason != hostile.expect:
            got = "no dead letter" if letter is None else f"reason {letter.reason}"
            out.unaccounted.append(f"{hostile.kind} @{item.partition}:{item.offset}: {got}, expected {hostile.expect}")
            continue
        out.accounted += 1
        out.dead_lettered += 1
        out.truncated_letters += letter.truncated
        if hostile.request_id and hostile.expect != "duplicate":
            answers = results.get(hostile.request_id, [])
            if answers and answers[0].get("outcome") == "rejected":
                out.rejected_answers += 1
            else:
                out.unaccounted.append(f"{hostile.kind}: dead-lettered but its sender got no `rejected` answer")
                out.accounted -= 1
    return out


async def hostile_input(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """A hostile corpus (oversized, malformed, wrong model, bad reply topics, duplicate ids) mixed into steady traffic."""
    device = CostModelDevice(a_ms=20.0, c_ms=1.0, target_size=8, hard_cap=16, max_wait_ms=10.0)
    async with Deployment(stage, device, partitions=2, consumer={"max_message_bytes": CONSUMER_MAX_MESSAGE_BYTES}) as d:
        proc = d.consumer("only")
        await d.warm_up(consumers=1)
        pid = proc.pid
        topics = d.topics
        hostile = HostileProducer(d.settings, topics.requests(CHAOS_MODEL))
        await hostile.start()
        rounds = max(3, sizes.requests // 200)
        duration_s = sizes.requests / sizes.rate_rps
        sending = asyncio.create_task(d.traffic.open_loop(sizes.requests, sizes.rate_rps))
        try:
            for n in range(rounds):
                await asyncio.sleep(duration_s / (rounds + 1))
                answered = next(
                    (i for i, a in d.ledger.results.items() if i in d.ledger.sent and a[0].outcome == "ok"), None
                )
                await hostile.send(hostile_corpus(topics, CHAOS_MODEL, f"{d.run_id}-{n}", answered))
            await sending
            fault_end = time.time()
        finally:
            await hostile.stop()
            if not sending.done():
                sending.cancel()
        await settle_answers(d, sizes)
        decoder = msgspec.json.Decoder(DeadLetter)
        letters = [decoder.decode(v) for v in await read_all(d.settings, topics.dlq)]
        results: dict[str, list[Any]] = {}
        for value in await read_all(d.settings, topics.results(CHAOS_MODEL)):
            answer = json.loads(value)
            results.setdefault(answer["id"], []).append(answer)
        accounting = account(hostile.sent, topics.requests(CHAOS_MODEL), letters, results)
        failures = accounting.unaccounted[:10]
        if len(accounting.unaccounted) > 10:
            failures.append(f"... {len(accounting.unaccounted) - 10} more hostile records unaccounted for")
        restarted = not proc.alive or proc.pid != pid
        if restarted:
            failures.append(f"the consumer stopped; its log ends:\n{proc.log_tail()}")
        not_ok = [i for i in d.ledger.sent if d.ledger.results.get(i) and d.ledger.results[i][0].outcome != "ok"]
        if not_ok:
            failures.append(f"{len(not_ok)} valid requests not answered ok (e.g. {not_ok[:3]})")
        return d.ledger.report(
            "hostile input mixed into traffic",
            len(hostile.sent),
            fault_end=fault_end,
            failures=failures,
            details={
                "hostile_records": len(hostile.sent),
                "hostile_accounted": accounting.accounted,
                "dead_lettered": accounting.dead_lettered,
                "truncated_dead_letters": accounting.truncated_letters,
                "rejected_answers": accounting.rejected_answers,
                "rerouted_answers": accounting.rerouted,
                "consumer_restarts": int(restarted),
            },
        )
