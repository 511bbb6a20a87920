"""Bad input never stops the consumer: the fuzz corpus replayed against a live consumer."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer

from consumers.answers import record_id
from pipeline.core.config import ConsumerSettings, KafkaSettings, ModelConfig
from pipeline.core.kafka.client import client_options
from pipeline.core.kafka.client import create_topics as create_topics_named
from tests.consumers.harness import collect, create_topics, make_consumer, request, running, send, topics

pytestmark = pytest.mark.kafka

CORPUS = Path(__file__).resolve().parents[1] / "fuzz_corpus"
REPLIES = "fuzz.replies"
"""The reply topic some corpus requests name (shared by test runs: read it by id)."""


def test_each_bad_input_reaches_the_dead_letter_topic_with_its_reason(kafka_settings: KafkaSettings) -> None:
    index = json.loads((CORPUS / "index.json").read_text())
    name = index["model"]
    model = ModelConfig(
        name=name,
        runner="zero-cost",
        partitions=1,
        max_input_tokens=index["max_input_tokens"],
        poison_marker=index["poison_marker"],
    )
    settings = ConsumerSettings(max_message_bytes=index["max_message_bytes"], commit_interval_ms=50)
    cases = index["cases"]
    before = [dict(request(i, "before"), model=name) for i in range(20)]
    after = [dict(request(i, "after"), model=name) for i in range(20)]

    async def scenario() -> None:
        await create_topics(kafka_settings, model)
        await create_topics_named(kafka_settings, {REPLIES: 1})
        requests = topics(kafka_settings).requests(name)
        consumer = make_consumer(model, kafka_settings, settings)
        async with running(consumer):
            await send(kafka_settings, requests, before)
            producer = AIOKafkaProducer(**client_options(kafka_settings), max_request_size=4 * 1024 * 1024)
            await producer.start()
            try:
                offsets: dict[str, int] = {}
                for case in cases:
                    value = (CORPUS / case["file"]).read_bytes() if case["file"] else None
                    headers = [(h["key"], base64.b64decode(h["value_b64"])) for h in case.get("headers", [])]
                    key = case["name"].encode()
                    meta = await (await producer.send(requests, value, key=key, partition=0, headers=headers or None))
                    offsets[case["name"]] = meta.offset
            finally:
                await producer.stop()
            await send(kafka_settings, requests, after)
            served = {json.loads((CORPUS / c["file"]).read_bytes())["id"] for c in cases if c["expect"] == "ok"}
            wanted = {r["id"] for r in before + after} | served
            replied = {p["id"] for p in map(_payload, cases) if isinstance(p, dict) and p.get("reply_topic") == REPLIES}
            results = await collect(kafka_settings, topics(kafka_settings).results(name), wanted - replied)
            replies = await collect(kafka_settings, REPLIES, replied, timeout_s=30)
            bad = [c for c in cases if c["expect"] != "ok"]
            dlq = await _dead_letters(kafka_settings, len(bad))
            by_offset = {letter["offset"]: letter for letter in dlq}
            counted = {
                by_offset[offsets[c["name"]]]["request_id"] or record_id(requests, 0, offsets[c["name"]]): c["expect"]
                for c in bad
                if c["expect"] != "duplicate"
            }
            repeated = {json.loads((CORPUS / c["file"]).read_bytes())["id"] for c in bad if c["expect"] == "duplicate"}
            events = await collect(
                kafka_settings,
                topics(kafka_settings).latency_events,
                set(counted) | repeated,
                key_field="request_id",
                grace_s=1.0,
                timeout_s=30,
            )
        assert wanted - replied <= set(results.by_id)
        for rid in wanted - replied:
            assert results.by_id[rid][0]["outcome"] == "ok", rid
        assert replies.by_id["fz-ok-text"][0]["outcome"] == "ok"
        assert replies.by_id["fz-prio-high"][0]["outcome"] == "rejected"
        assert replies.by_id["fz-other-model"][0]["outcome"] == "rejected"
        for case in bad:
            letter = by_offset.get(offsets[case["name"]])
            assert letter is not None, f"{case['name']}: no dead letter"
            assert letter["reason"] == case["expect"], (case["name"], letter["reason"], letter["detail"])
            assert letter["topic"] == requests and letter["detail"]
            if case["file"]:
                assert base64.b64decode(letter["original_b64"]) == (CORPUS / case["file"]).read_bytes()
        poison = next(c for c in cases if c["expect"] == "runner_error")
        poison_id = json.loads((CORPUS / poison["file"]).read_bytes())["id"]
        assert results.by_id[poison_id][0]["outcome"] == "error"
        assert consumer.stats.dead_letters == len(bad)
        # every refusal is counted once, with its reason, whether or not its id could be read
        assert len(counted) == len(bad) - len(repeated) and any(rid.startswith("record:") for rid in counted)
        for rid, reason in counted.items():
            (event,) = events.by_id[rid]
            outcome = "error" if reason == "runner_error" else "rejected"
            assert (event["outcome"], event["reason"]) == (outcome, reason), (rid, event)
            assert event["model"] == name and event["warmup"] is False
        for rid in repeated:  # a duplicate repeats a request already counted: its one event stands
            (event,) = events.by_id[rid]
            assert (event["outcome"], event["reason"]) == ("ok", "")

    asyncio.run(scenario())


def _payload(case: dict) -> object:
    """The case's JSON body, or None for files that are not valid JSON (the point of many)."""
    try:
        return json.loads((CORPUS / case["file"]).read_bytes()) if case["file"] else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


async def _dead_letters(kafka: KafkaSettings, n: int) -> list[dict]:
    from tests.support.kafka import consume_n, json_values

    return json_values(await consume_n(kafka, topics(kafka).dlq, n, timeout_s=30))
