"""Where answers go: reply topics with rules, requests for another model, duplicate ids."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest

from pipeline.core.config import KafkaSettings
from tests.consumers.harness import (
    MODEL,
    collect,
    configure_topic,
    cost_model,
    request,
    send,
    serving,
    topics,
)
from tests.support.kafka import consume_n, json_values

pytestmark = pytest.mark.kafka

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def _validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads((SCHEMAS / f"{name}.schema.json").read_text()))


def test_reply_topics_follow_the_documented_rules(kafka_settings: KafkaSettings) -> None:
    model = cost_model(partitions=2)
    names = topics(kafka_settings)
    app = f"{kafka_settings.topic_prefix}-app"  # outside the pipeline's prefix ("<prefix>.")
    own = request(0, "own", reply_topic=names.results(MODEL))
    other_model = request(0, "other-model", reply_topic=names.results("another"))
    request_topic = request(0, "request-topic", reply_topic=names.requests(MODEL))
    internal = request(0, "internal", reply_topic="__consumer_offsets")
    missing = request(0, "missing", reply_topic=f"{app}.missing")
    client = request(0, "client", reply_topic=f"{app}.answers")
    tiny = request(0, "tiny", reply_topic=f"{app}.tiny")
    wrong_model = dict(request(0, "wrong-model"), model="nobody")
    wrong_model_replied = dict(request(0, "wrong-model-replied", reply_topic=f"{app}.answers"), model="nobody")
    wrong_model_into = dict(request(0, "wrong-model-into", reply_topic=names.results("another")), model="nobody")
    bad_priority_into = request(0, "bad-priority-into", reply_topic=names.results("another"), priority=99)
    plain = [request(i) for i in range(10)]
    refused = {other_model["id"]: "reply_topic", request_topic["id"]: "reply_topic", internal["id"]: "reply_topic"}
    refused[wrong_model["id"]] = "model_mismatch"
    refused[wrong_model_into["id"]] = "model_mismatch"  # refused for its model, answered on ours all the same
    refused[bad_priority_into["id"]] = "schema"

    async def scenario() -> None:
        await configure_topic(kafka_settings, f"{app}.answers", {})
        await configure_topic(kafka_settings, f"{app}.tiny", {"max.message.bytes": "150"})
        await configure_topic(kafka_settings, names.results("another"), {})  # where a leak would land
        async with serving(model, kafka_settings) as consumer:
            hostile = [
                own,
                other_model,
                request_topic,
                internal,
                missing,
                client,
                tiny,
                wrong_model,
                wrong_model_replied,
            ]
            hostile += [wrong_model_into, bad_priority_into]
            await send(kafka_settings, names.requests(MODEL), hostile + plain)
            on_results = {r["id"] for r in plain} | {own["id"], missing["id"], tiny["id"]} | set(refused)
            results = await collect(kafka_settings, names.results(MODEL), on_results, grace_s=1.0)
            replies = await collect(kafka_settings, f"{app}.answers", {client["id"], wrong_model_replied["id"]})
            letters = json_values(await consume_n(kafka_settings, names.dlq, len(refused) + 1))
            leaked = await collect(kafka_settings, names.results("another"), set(), grace_s=0.5)
        assert consumer._failure is None
        assert not results.duplicates and set(results.by_id) == on_results
        result_schema, letter_schema = _validator("result"), _validator("dead_letter")
        for answers in [*results.by_id.values(), *replies.by_id.values()]:
            result_schema.validate(answers[0])
        for letter in letters:
            letter_schema.validate(letter)
        for rid in {r["id"] for r in plain} | {own["id"]}:
            assert results.by_id[rid][0]["outcome"] == "ok" and "reply_error" not in results.by_id[rid][0]
        for rid, reason in refused.items():
            answer = results.by_id[rid][0]
            assert answer["outcome"] == "rejected" and answer["error"].startswith(f"{reason}: "), answer
            assert "reply_error" not in answer, "a refused reply topic is never tried"
        assert not leaked.by_id, "nothing is ever written to another model's results topic"
        moved = results.by_id[missing["id"]][0]
        assert moved["outcome"] == "ok" and "does not exist" in moved["reply_error"]
        too_big = results.by_id[tiny["id"]][0]
        assert too_big["outcome"] == "ok" and "max.message.bytes (150)" in too_big["reply_error"]
        assert replies.by_id[client["id"]][0]["outcome"] == "ok"
        assert replies.by_id[wrong_model_replied["id"]][0]["outcome"] == "rejected"
        assert {letter["request_id"]: letter["reason"] for letter in letters} == {
            **refused,
            wrong_model_replied["id"]: "model_mismatch",
        }
        assert consumer.stats.rebuilt >= 2

    asyncio.run(scenario())


def test_a_duplicate_id_gets_one_answer_and_a_dead_letter(kafka_settings: KafkaSettings) -> None:
    """The first answer stands; a later record with the same id is dead-lettered, never answered again."""
    model = cost_model(partitions=1)
    names = topics(kafka_settings)
    first = request(0, "dup")
    again = dict(first, text="the same id, other text")

    async def scenario() -> None:
        async with serving(model, kafka_settings) as consumer:
            await send(kafka_settings, names.requests(MODEL), [first])
            await collect(kafka_settings, names.results(MODEL), {first["id"]}, grace_s=0)
            # the answer can be on the broker a moment before the consumer has its ack: resend
            # only once the consumer remembers it answered, so the dead letter says "already answered"
            for _ in range(200):
                if first["id"] in consumer._admission.answered:
                    break
                await asyncio.sleep(0.05)
            await send(kafka_settings, names.requests(MODEL), [again, request(1)])
            results = await collect(kafka_settings, names.results(MODEL), {first["id"], "r1"}, grace_s=1.0)
            (letter,) = json_values(await consume_n(kafka_settings, names.dlq, 1))
        assert len(results.by_id[first["id"]]) == 1 and results.by_id[first["id"]][0]["outcome"] == "ok"
        assert (letter["reason"], letter["request_id"], letter["offset"]) == ("duplicate", first["id"], 1)
        assert "already answered" in letter["detail"]
        assert consumer.stats.answered["ok"] == 2 and consumer.stats.dead_letters == 1

    asyncio.run(scenario())
