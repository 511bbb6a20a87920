"""No record stops a consumer by its size: big requests are dead-lettered in a form that fits, and
the requests behind them are answered."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import json
from pathlib import Path

import jsonschema
import pytest

from consumers.worker import Consumer
from pipeline.core.config import ConsumerSettings, KafkaSettings, ModelConfig
from pipeline.core.kafka.topic_limits import KAFKA_DEFAULT_MAX_MESSAGE_BYTES
from tests.consumers.harness import (
    MODEL,
    collect,
    committed_offsets,
    configure_topic,
    cost_model,
    produce_raw,
    request,
    send,
    serving,
    topics,
)
from tests.support.kafka import consume_n, json_values

pytestmark = pytest.mark.kafka

TEN_MB = 10 * 1024 * 1024
SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"
DEAD_LETTER_SCHEMA = jsonschema.Draft202012Validator(json.loads((SCHEMAS / "dead_letter.schema.json").read_text()))


def _big_request(request_id: str, size: int) -> bytes:
    """Valid JSON of exactly `size` bytes whose text is far over the schema's limit."""
    head = json.dumps({"id": request_id, "model": MODEL, "text": ""}).encode()
    return head[:-2] + b"x" * (size - len(head)) + head[-2:]


async def _wait_committed(kafka: KafkaSettings, consumer: Consumer, expected: int) -> int:
    names = topics(kafka)
    for _ in range(100):
        committed = sum((await committed_offsets(kafka, names.requests(MODEL), 1, consumer.group_id)).values())
        if committed >= expected:
            return committed
        await asyncio.sleep(0.1)
    return committed


def _check_letter(letter: dict, original: bytes, limit: int) -> bytes:
    DEAD_LETTER_SCHEMA.validate(letter)
    kept = base64.b64decode(letter["original_b64"])
    assert letter["original_size"] == len(original)
    assert letter["original_sha256"] == hashlib.sha256(original).hexdigest()
    assert letter["truncated"] is True and original.startswith(kept)
    assert limit // 2 < len(kept) * 4 / 3 < limit, "as much of the original as fits, not a token prefix"
    return kept


def test_a_request_just_under_the_brokers_limit_is_answered_and_dead_lettered_truncated(
    kafka_settings: KafkaSettings,
) -> None:
    """The issue's poison pill: a valid-JSON request the broker accepts whose base64 copy does not fit the DLQ."""
    model = cost_model(partitions=1)
    big = _big_request("big", KAFKA_DEFAULT_MAX_MESSAGE_BYTES - 1024)
    before = [request(i, "before") for i in range(5)]
    after = [request(i, "after") for i in range(20)]

    async def scenario() -> None:
        names = topics(kafka_settings)
        async with serving(model, kafka_settings) as consumer:
            await send(kafka_settings, names.requests(MODEL), before)
            offset = await produce_raw(kafka_settings, names.requests(MODEL), big, key=b"big")
            await send(kafka_settings, names.requests(MODEL), after)
            ids = {r["id"] for r in before + after} | {"big"}
            results = await collect(kafka_settings, names.results(MODEL), ids, grace_s=0.2)
            letters = json_values(await consume_n(kafka_settings, names.dlq, 1))
            committed = await _wait_committed(kafka_settings, consumer, len(before) + 1 + len(after))
        assert consumer._failure is None
        assert all(results.by_id[r["id"]][0]["outcome"] == "ok" for r in before + after)
        answer = results.by_id["big"][0]
        assert answer["outcome"] == "rejected" and answer["error"].startswith("schema: text")
        (letter,) = letters
        assert (letter["reason"], letter["topic"], letter["partition"], letter["offset"]) == (
            "schema",
            names.requests(MODEL),
            0,
            offset,
        )
        _check_letter(letter, big, KAFKA_DEFAULT_MAX_MESSAGE_BYTES)
        assert committed == len(before) + 1 + len(after)

    asyncio.run(scenario())


def test_a_topic_raised_to_10_mb_serves_on_past_its_giant_records(kafka_settings: KafkaSettings) -> None:
    """A 6 MB request is decoded and refused by the schema; a 9.5 MB one is refused from its size alone."""
    model = cost_model(partitions=1)
    settings = ConsumerSettings(commit_interval_ms=50, max_message_bytes=8 * 1024 * 1024)
    decoded = _big_request("six", 6 * 1024 * 1024)
    giant = _big_request("giant", int(9.5 * 1024 * 1024))
    after = [request(i, "after") for i in range(10)]

    async def scenario() -> None:
        names = topics(kafka_settings)
        await configure_topic(kafka_settings, names.requests(MODEL), {"max.message.bytes": str(TEN_MB)})
        async with serving(model, kafka_settings, settings) as consumer:
            await produce_raw(kafka_settings, names.requests(MODEL), decoded, key=b"six")
            await produce_raw(kafka_settings, names.requests(MODEL), giant, key=b"giant")
            await send(kafka_settings, names.requests(MODEL), after)
            ids = {r["id"] for r in after} | {"six"}
            results = await collect(kafka_settings, names.results(MODEL), ids, grace_s=0.5, timeout_s=90)
            letters = json_values(await consume_n(kafka_settings, names.dlq, 2, timeout_s=60))
            committed = await _wait_committed(kafka_settings, consumer, 2 + len(after))
        assert consumer._failure is None
        assert all(results.by_id[r["id"]][0]["outcome"] == "ok" for r in after)
        assert results.by_id["six"][0]["outcome"] == "rejected"
        assert "giant" not in results.by_id, "an oversize record is refused before its id is read"
        by_reason = {letter["reason"]: letter for letter in letters}
        assert set(by_reason) == {"schema", "oversize"}
        assert by_reason["schema"]["request_id"] == "six"
        _check_letter(by_reason["schema"], decoded, KAFKA_DEFAULT_MAX_MESSAGE_BYTES)
        oversize = by_reason["oversize"]
        assert oversize["request_id"] is None and str(len(giant)) in oversize["detail"]
        _check_letter(oversize, giant, KAFKA_DEFAULT_MAX_MESSAGE_BYTES)
        assert committed == 2 + len(after)

    asyncio.run(scenario())


@pytest.mark.parametrize("transactional", [False, True], ids=["at-least-once", "transactions"])
def test_a_dead_letter_topic_shrunk_under_a_running_consumer(
    kafka_settings: KafkaSettings, transactional: bool
) -> None:
    """The broker refuses a letter built for the limit the consumer cached: it is rebuilt until it fits."""
    kafka = dataclasses.replace(kafka_settings, transactional=transactional)
    model = cost_model(partitions=1)
    limit = 100_000
    bad = _big_request("bad", 600_000)
    after = [request(i, "after") for i in range(10)]

    async def scenario() -> None:
        names = topics(kafka)
        async with serving(model, kafka) as consumer:
            await configure_topic(kafka, names.dlq, {"max.message.bytes": str(limit)})
            await asyncio.sleep(1.0)  # the broker applies topic configs asynchronously
            await produce_raw(kafka, names.requests(MODEL), bad, key=b"bad")
            await send(kafka, names.requests(MODEL), after)
            ids = {r["id"] for r in after} | {"bad"}
            results = await collect(kafka, names.results(MODEL), ids, grace_s=0.5)
            letters = json_values(await consume_n(kafka, names.dlq, 1, isolation_level="read_committed"))
            committed = await _wait_committed(kafka, consumer, 1 + len(after))
        assert consumer._failure is None
        assert results.by_id["bad"][0]["outcome"] == "rejected" and not results.duplicates
        (letter,) = letters
        kept = _check_letter(letter, bad, limit)
        assert len(kept) < limit
        assert consumer.stats.rebuilt >= 2, "built for ~1 MB, refused, rebuilt smaller"
        assert committed == 1 + len(after)

    asyncio.run(scenario())


@pytest.mark.model
@pytest.mark.parametrize(
    ("lowered", "transactional"),
    [(False, False), (True, False), (False, True)],
    ids=["limit-known", "limit-lowered", "limit-known-transactions"],
)
def test_an_answer_shrunk_to_an_error_gets_an_error_event(
    kafka_settings: KafkaSettings, tiny_bert_dir: Path, lowered: bool, transactional: bool
) -> None:
    """An embedding too large for the results topic is answered `error`, and its latency event says so
    (reason `oversize`): whether the consumer knew the limit before sending or the broker refused first."""
    kafka = dataclasses.replace(kafka_settings, transactional=transactional)
    model = ModelConfig(
        name=MODEL,
        runner="transformers",
        model_path=str(tiny_bert_dir),
        task="embed",
        device="cpu",
        isolation="thread",
        torch_threads=1,
        partitions=1,
    )
    limit = 700  # a 32-float embedding answer is ~900 bytes; the error answer saying why is ~400
    asks = [request(i, "big") for i in range(4)]
    ids = {r["id"] for r in asks}

    async def scenario() -> None:
        names = topics(kafka)
        if not lowered:
            await configure_topic(kafka, names.results(MODEL), {"max.message.bytes": str(limit)})
        async with serving(model, kafka) as consumer:
            if lowered:
                await configure_topic(kafka, names.results(MODEL), {"max.message.bytes": str(limit)})
                await asyncio.sleep(1.0)  # the broker applies topic configs asynchronously
            await send(kafka, names.requests(MODEL), asks)
            results = await collect(kafka, names.results(MODEL), ids, grace_s=0.5)
            events = await collect(kafka, names.latency_events, ids, key_field="request_id", grace_s=0.5)
        assert consumer._failure is None
        for rid in ids:
            (answer,) = results.by_id[rid]
            assert answer["outcome"] == "error" and "is larger than max.message.bytes" in answer["error"], answer
            assert answer.get("embedding") is None
            (event,) = events.by_id[rid]
            assert (event["outcome"], event["reason"]) == ("error", "oversize"), event
        if lowered:
            assert consumer.stats.rebuilt >= len(ids), "built for the old limit, refused, rebuilt as errors"

    asyncio.run(scenario())
