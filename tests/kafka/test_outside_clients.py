"""A client the project does not use itself (confluent-kafka, i.e. librdkafka) talks to a live
consumer: requests built from the exported JSON Schema alone, answers read back with it.

Keys, headers, CreateTime, gzip/lz4/zstd compression and a SASL listener must all work from
outside, and answers must land on the partition Java's (and librdkafka's murmur2) partitioner
picks for the request id.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, Consumer, Producer

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import create_topics
from tests.consumers.harness import MODEL, cost_model, make_consumer, running, topics
from tests.support.kafka import SASL_USERS

pytestmark = pytest.mark.kafka

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"
CODECS = ("gzip", "lz4", "zstd")
PER_CODEC = 30


def _schema(name: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / f"{name}.schema.json").read_text())


def _requests_from_schema(codec: str) -> list[dict[str, Any]]:
    """What a producer in another language writes, knowing only request.schema.json."""
    schema = _schema("request")
    definition = schema["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    fields = definition["properties"]
    assert set(definition["required"]) == {"id", "model"} and {"text", "priority", "timeout_ms"} <= set(fields)
    validator = jsonschema.Draft202012Validator(schema)
    out = []
    for i in range(PER_CODEC):
        value = {
            "id": f"{codec}-{i}",
            "model": MODEL,
            "text": f"from librdkafka {i}",
            "priority": i % 3,
            "timeout_ms": 60_000,
        }
        validator.validate(value)
        out.append(value)
    return out


def _client_config(kafka: KafkaSettings, mechanism: str | None) -> dict[str, Any]:
    config: dict[str, Any] = {"bootstrap.servers": kafka.bootstrap_servers}
    if mechanism is not None:
        user, password = next(iter(SASL_USERS.items()))
        config |= {
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": mechanism,
            "sasl.username": user,
            "sasl.password": password,
        }
    return config


def _produce(config: dict[str, Any], topic: str, codec: str, values: list[dict[str, Any]], stamp_ms: int) -> None:
    producer = Producer(config | {"compression.type": codec, "linger.ms": 20, "partitioner": "murmur2_random"})
    errors: list[Any] = []
    for value in values:
        producer.produce(
            topic,
            json.dumps(value).encode(),
            key=value["id"].encode(),
            headers=[("trace-id", uuid.uuid4().hex.encode()), ("origin", b"confluent-kafka")],
            timestamp=stamp_ms,
            on_delivery=lambda err, _msg: errors.append(err) if err else None,
        )
    assert producer.flush(30) == 0 and not errors, errors


def _answers(config: dict[str, Any], topic: str, ids: set[str], timeout_s: float = 90.0) -> dict[str, Any]:
    consumer = Consumer(
        config
        | {
            "group.id": f"outside-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
        }
    )
    consumer.subscribe([topic])
    got: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while not ids <= got.keys() and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None or message.error():
                continue
            key = message.key()
            assert key is not None, "every record here has a key"
            got[key.decode()] = message
    finally:
        consumer.close()
    return got


def _placement(config: dict[str, Any], topic: str, keys: list[str]) -> dict[str, int]:
    """The partition librdkafka's murmur2 partitioner (Java's default) picks for each key."""
    producer = Producer(config | {"partitioner": "murmur2_random"})
    placed: dict[str, int] = {}

    def delivered(_error: object, message: Any) -> None:
        key, partition = message.key(), message.partition()
        assert key is not None and partition is not None
        placed[key.decode()] = partition

    for key in keys:
        producer.produce(topic, b"probe", key=key.encode(), on_delivery=delivered)
    assert producer.flush(30) == 0
    return placed


def _round_trip(kafka: KafkaSettings, mechanism: str | None, codecs: tuple[str, ...]) -> None:
    # The records are stamped 1.5 s in the past (their CreateTime must come back as enqueue_ms), past
    # the default 1 s SLO: the default shed_when = "slo" would rightly answer them expired
    # (cannot_meet_slo), so this test of outside clients runs what can still meet its 60 s deadline.
    model = cost_model(partitions=4, shed_when="deadline")
    names = topics(kafka)
    outside = _client_config(kafka, mechanism)
    stamp_ms = int(time.time() * 1000) - 1500
    sent = {codec: _requests_from_schema(codec) for codec in codecs}
    ids = {v["id"] for values in sent.values() for v in values}
    probe = f"{kafka.topic_prefix}-probe"

    async def scenario() -> dict[str, Any]:
        await create_topics(
            kafka, {names.requests(MODEL): 4, names.priority(MODEL): 4, names.results(MODEL): 4, probe: 4}
        )
        await create_topics(kafka, dict.fromkeys(names.shared, kafka.events_partitions))
        async with running(make_consumer(model, kafka)) as consumer:
            for codec, values in sent.items():
                await asyncio.to_thread(_produce, outside, names.requests(MODEL), codec, values, stamp_ms)
            got = await asyncio.to_thread(_answers, outside, names.results(MODEL), ids)
        assert consumer.stats.dead_letters == 0 and consumer._failure is None
        return got

    got = asyncio.run(scenario())
    assert set(got) == ids
    result_schema = jsonschema.Draft202012Validator(_schema("result"))
    placed = _placement(outside, probe, sorted(ids))
    for rid, message in got.items():
        answer = json.loads(message.value())
        result_schema.validate(answer)
        assert answer["id"] == rid and answer["outcome"] == "ok"
        assert answer["enqueue_ms"] == stamp_ms, "the request's CreateTime is its enqueue time"
        kind, _ = message.timestamp()
        assert kind == TIMESTAMP_CREATE_TIME
        assert message.partition() == placed[rid], "answers sit where Java's partitioner puts the request id"


def test_confluent_kafka_producer_and_consumer_with_every_codec(kafka_settings: KafkaSettings) -> None:
    _round_trip(kafka_settings, None, CODECS)


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256"])
def test_confluent_kafka_over_sasl(sasl_kafka_settings: KafkaSettings, mechanism: str) -> None:
    _round_trip(sasl_kafka_settings, mechanism, ("zstd",))


README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_kcat_lines() -> list[str]:
    """The README's kcat block, its continuation lines joined."""
    block = next(b for b in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S) if "kcat" in b)
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


@pytest.mark.skipif(shutil.which("kcat") is None, reason="kcat is not installed (apt-get install kcat)")
def test_the_readme_kcat_lines_round_trip(kafka_settings: KafkaSettings) -> None:
    """The README's kcat lines, run against this session's broker and topics, ask a live consumer
    and read its answer back, keyed by the request id."""
    produce, read = (
        line.replace("127.0.0.1:9092", kafka_settings.bootstrap_servers)
        .replace("batchtide.", f"{kafka_settings.topic_prefix}.")
        .replace("minilm", MODEL)
        for line in _readme_kcat_lines()
    )
    assert "kcat -P" in produce and "kcat -C" in read
    names = topics(kafka_settings)
    request_id = json.loads(re.search(r"\|(\{.*?\})'", produce).group(1))["id"]  # type: ignore[union-attr]

    async def scenario() -> str:
        await create_topics(
            kafka_settings, {names.requests(MODEL): 4, names.priority(MODEL): 4, names.results(MODEL): 4}
        )
        await create_topics(kafka_settings, dict.fromkeys(names.shared, kafka_settings.events_partitions))
        async with running(make_consumer(cost_model(partitions=4), kafka_settings)):
            sent = await asyncio.to_thread(
                subprocess.run, ["bash", "-c", produce], capture_output=True, text=True, timeout=60
            )
            assert sent.returncode == 0, sent.stderr
            got = await asyncio.to_thread(
                _answers, _client_config(kafka_settings, None), names.results(MODEL), {request_id}
            )
            assert request_id in got
        shown = await asyncio.to_thread(
            subprocess.run, ["bash", "-c", read], capture_output=True, text=True, timeout=60
        )
        assert shown.returncode == 0, shown.stderr
        return shown.stdout

    line = next(line for line in asyncio.run(scenario()).splitlines() if line.startswith(f"{request_id} => "))
    answer = json.loads(line.split(" => ", 1)[1])
    assert answer["id"] == request_id and answer["outcome"] == "ok"
