"""Share-group mode against a real Kafka 4.x broker: several consumers on one partition, each record
acknowledged once its answer is on the broker, records given back when a consumer stops or dies,
unreadable records rejected after their dead letter."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from consumers.worker import Consumer
from pipeline.core.config import Config, ConsumerSettings, KafkaSettings
from pipeline.core.kafka.first_answers import FirstAnswers
from pipeline.core.kafka.lag_probe import LagProbe
from pipeline.core.kafka.reader import TopicReader
from pipeline.core.kafka.share_client import ShareGroupsUnavailable, prepare_share_group, set_group_config
from pipeline.tools.commands.status import collect as collect_status
from pipeline.tools.commands.status import render
from tests.consumers.harness import (
    MODEL,
    collect,
    cost_model,
    create_topics,
    make_consumer,
    request,
    running,
    send,
    topics,
)

pytestmark = pytest.mark.kafka

SHARE = ConsumerSettings(group_type="share", lag_interval_ms=0, fleet_beacon_ms=0)
_broker_shares: dict[str, str | None] = {}


@pytest.fixture(autouse=True)
def _share_groups(request: pytest.FixtureRequest) -> None:
    """Skip (saying why) where the session broker runs no share groups: Kafka older than 4.2, as when
    the suite runs on BATCHTIDE_KAFKA_VERSION=3.9.1."""
    if "kafka_settings" not in request.fixturenames:
        return
    kafka: KafkaSettings = request.getfixturevalue("kafka_settings")
    if kafka.bootstrap_servers not in _broker_shares:
        try:
            asyncio.run(prepare_share_group(kafka, f"{kafka.topic_prefix}.probe"))
            _broker_shares[kafka.bootstrap_servers] = None
        except ShareGroupsUnavailable as e:
            _broker_shares[kafka.bootstrap_servers] = str(e)
    why = _broker_shares[kafka.bootstrap_servers]
    if why is not None:
        pytest.skip(why)


def group(kafka: KafkaSettings) -> str:
    return topics(kafka).share_group(MODEL)


async def share_lag(kafka: KafkaSettings, partitions: int) -> list[int]:
    """Records not acknowledged on each request partition, as the broker counts them for the share
    group (its start offset is its last persisted state and may trail: not asserted on)."""
    requests = topics(kafka).requests(MODEL)
    async with LagProbe(kafka) as probe:
        lags = await probe.measure_share(group(kafka), [TopicPartition(requests, p) for p in range(partitions)])
    return [lag.lag for lag in lags]


def test_two_share_consumers_on_one_partition_both_get_work(kafka_settings: KafkaSettings) -> None:
    """One partition, two consumers: a partition group would leave one idle; a share group feeds both."""
    model = cost_model(a_ms=20.0, c_ms=1.0, partitions=1, target_size=8, max_wait_ms=5)
    wanted = [request(i) for i in range(300)]

    async def scenario() -> None:
        await create_topics(kafka_settings, model)
        first = make_consumer(model, kafka_settings, SHARE, "c1")
        second = make_consumer(model, kafka_settings, SHARE, "c2")
        requests = topics(kafka_settings).requests(MODEL)
        async with running(first), running(second):
            warm = await _until_each_fetched(kafka_settings, requests, (first, second))
            before = {c.consumer_id: sum(c.stats.answered.values()) for c in (first, second)}
            await send(kafka_settings, requests, wanted, partition=0)
            ids = {r["id"] for r in wanted} | warm
            answers = await collect(kafka_settings, topics(kafka_settings).results(MODEL), ids)
            (status,) = await collect_status(Config(kafka=kafka_settings, consumer=SHARE), [MODEL])
        assert set(answers.by_id) == ids
        assert answers.duplicates == {}
        total = {c.consumer_id: sum(c.stats.answered.values()) for c in (first, second)}
        served = {member: total[member] - before[member] for member in total}
        assert all(n >= 30 for n in served.values()), served
        # a warm-up request still in flight at `before` is answered after it: count every request once
        assert sum(total.values()) == len(ids)
        # the last polls' acknowledgements reach the broker's count a moment after the answers do
        assert await _wait_for(lambda: share_lag(kafka_settings, 1), lambda got: got == [0], 20) == [0]
        assert status.share and status.group == group(kafka_settings)
        assert {m["client_id"] for m in status.members} == {"c1", "c2"}
        assert all(f"{requests}:0" in m["partitions"] for m in status.members), status.members
        assert "shared by" in render([status], time.time() * 1000)
        for consumer in (first, second):  # what a slower peer's pull rule reads in their beacons
            beacon = consumer.beacon()
            assert beacon.batches == consumer.forwarding.batches > 0
            assert beacon.drained_at_ms is not None, "a poll that left the broker empty is told"

    asyncio.run(scenario())


async def _until_each_fetched(
    kafka: KafkaSettings, topic: str, consumers: tuple[Consumer, ...], timeout_s: float = 30.0
) -> set[str]:
    """A trickle of requests until every consumer has fetched one: a share group hands a new member
    its partitions on a heartbeat (every 5 s by the broker's default), not at once. Returns their ids."""
    sent: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while any(c.stats.fetched == 0 for c in consumers) and time.monotonic() < deadline:
        value = request(len(sent), "warm")
        await send(kafka, topic, [value], partition=0)
        sent.add(value["id"])
        await asyncio.sleep(0.1)
    assert all(c.stats.fetched for c in consumers), "a share consumer got no partition in time"
    return sent


def test_a_record_is_accepted_only_once_its_answer_is_on_the_broker(kafka_settings: KafkaSettings) -> None:
    """While the results topic cannot take answers, the records stay unacknowledged on the broker; the
    moment the answers land, the share group's start offset passes them."""
    model = cost_model(partitions=1, target_size=4, max_wait_ms=1)
    wanted = [request(i) for i in range(20)]
    results = topics(kafka_settings).results(MODEL)

    async def scenario() -> None:
        await create_topics(kafka_settings, model)
        await _refuse_writes(kafka_settings, results)
        consumer = make_consumer(model, kafka_settings, SHARE)
        async with running(consumer):
            await send(kafka_settings, topics(kafka_settings).requests(MODEL), wanted, partition=0)
            deadline = time.monotonic() + 30
            while consumer.stats.batches == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.sleep(2.0)  # the delivery keeps retrying meanwhile
            assert consumer.stats.batches > 0
            assert await share_lag(kafka_settings, 1) == [len(wanted)]
            await _allow_writes(kafka_settings, results)
            answers = await collect(kafka_settings, results, {r["id"] for r in wanted})
            deadline = time.monotonic() + 20
            while await share_lag(kafka_settings, 1) != [0] and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
        assert set(answers.by_id) == {r["id"] for r in wanted}
        assert await share_lag(kafka_settings, 1) == [0]

    asyncio.run(scenario())


def test_the_priority_subscription_is_drained_before_the_request_backlog(kafka_settings: KafkaSettings) -> None:
    """Priority requests waiting behind a backlog of plain ones run within the first batches: the priority
    member polls whatever the device is doing, the request members only when a slot is free."""
    model = cost_model(a_ms=100.0, c_ms=0.0, partitions=1, hard_cap=4, target_size=4, max_wait_ms=1)
    backlog = [request(i) for i in range(40)]
    urgent = [request(i, "urgent") for i in range(4)]
    tp = topics(kafka_settings)

    async def scenario() -> None:
        await create_topics(kafka_settings, model)
        await prepare_share_group(kafka_settings, group(kafka_settings))  # start at the earliest record
        await send(kafka_settings, tp.requests(MODEL), backlog, partition=0)
        await send(kafka_settings, tp.priority(MODEL), urgent, partition=0)
        async with running(make_consumer(model, kafka_settings, SHARE)):
            answers = await collect(kafka_settings, tp.results(MODEL), {r["id"] for r in backlog + urgent})
        done = {rid: values[0]["done_ms"] for rid, values in answers.by_id.items()}
        plain = sorted(done[r["id"]] for r in backlog)
        last_urgent = max(done[r["id"]] for r in urgent)
        # 10 batches of plain requests; the urgent four finish before the third of them
        assert last_urgent <= plain[8], (last_urgent, plain)
        assert answers.duplicates == {}

    asyncio.run(scenario())


def test_an_expired_request_is_answered_expired_and_accepted_not_released(kafka_settings: KafkaSettings) -> None:
    """A request the engine will not run in time is answered `expired` and ACCEPTed: releasing it would only
    hand another member a request that is already late."""
    model = cost_model(a_ms=300.0, c_ms=0.0, partitions=1, hard_cap=4, target_size=4, max_wait_ms=1)
    now = int(time.time() * 1000)
    late = [request(i, "late", deadline_ms=now - 1000) for i in range(6)]
    short = [request(i, "short", timeout_ms=100) for i in range(12)]
    ids = {r["id"] for r in late + short}
    tp = topics(kafka_settings)

    async def scenario() -> None:
        await create_topics(kafka_settings, model)
        consumer = make_consumer(model, kafka_settings, SHARE)
        async with running(consumer):
            await send(kafka_settings, tp.requests(MODEL), late + short, partition=0)
            answers = await collect(kafka_settings, tp.results(MODEL), ids)
            deadline = time.monotonic() + 20
            while await share_lag(kafka_settings, 1) != [0] and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            lag = await share_lag(kafka_settings, 1)
        outcomes = {rid: values[0]["outcome"] for rid, values in answers.by_id.items()}
        assert all(outcomes[r["id"]] == "expired" for r in late)
        expired = sum(o == "expired" for o in outcomes.values())
        assert expired >= len(late) + 4, outcomes
        assert lag == [0]
        assert consumer.stats.share_released == 0
        assert consumer.stats.share_accepted == len(ids)

    asyncio.run(scenario())


async def _refuse_writes(kafka: KafkaSettings, topic: str) -> None:
    """Records on `topic` are refused (message size limit of 1 byte) until `_allow_writes`."""
    from tests.consumers.harness import configure_topic

    await configure_topic(kafka, topic, {"max.message.bytes": "1"})


async def _allow_writes(kafka: KafkaSettings, topic: str) -> None:
    from tests.consumers.harness import configure_topic

    await configure_topic(kafka, topic, {"max.message.bytes": "1048588"})


def test_a_consumer_stopped_mid_batch_gives_its_records_back_and_each_is_answered_once(
    kafka_settings: KafkaSettings,
) -> None:
    """A consumer whose stop budget runs out mid-batch releases what it holds; its peer answers it.
    Readers keep the first answer per id, so nothing is answered twice downstream of them."""
    slow = cost_model(a_ms=3000.0, c_ms=0.0, partitions=1, target_size=64, max_wait_ms=1)
    fast = cost_model(a_ms=5.0, c_ms=0.5, partitions=1, target_size=8, max_wait_ms=1)
    wanted = [request(i) for i in range(60)]
    requests, results = topics(kafka_settings).requests(MODEL), topics(kafka_settings).results(MODEL)

    async def scenario() -> None:
        await create_topics(kafka_settings, slow)
        quitter = make_consumer(slow, kafka_settings, ConsumerSettings(group_type="share", stop_timeout_s=0.5), "slow")
        await quitter.start()
        stop = asyncio.Event()
        task = asyncio.create_task(quitter.run(stop))
        await send(kafka_settings, requests, wanted, partition=0)
        deadline = time.monotonic() + 30
        while quitter.stats.batches == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert quitter.stats.batches > 0
        stop.set()
        await asyncio.wait_for(task, 30)
        assert sum(quitter.stats.answered.values()) == 0
        async with running(make_consumer(fast, kafka_settings, SHARE, "fast")):
            answers = await collect(kafka_settings, results, {r["id"] for r in wanted})
        assert set(answers.by_id) == {r["id"] for r in wanted}
        assert _past_dedup(answers) == {}

    asyncio.run(scenario())


def _past_dedup(answers: object) -> dict[str, int]:
    """Ids a FirstAnswers reader would hand out more than once."""
    reader, handed = FirstAnswers(), dict[str, int]()
    for request_id, values in answers.by_id.items():  # type: ignore[attr-defined]
        for value in values:
            if reader.first(request_id, int(value.get("done_ms") or 0)):
                handed[request_id] = handed.get(request_id, 0) + 1
    return {k: n for k, n in handed.items() if n > 1}


def test_a_killed_consumers_records_come_back_after_the_lock_and_are_answered_once_downstream(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    """SIGKILL mid-batch: nothing is released, so the records come back when their lock expires
    (15 s here, the least a group may set) and the other consumer answers them."""
    wanted = [request(i) for i in range(40)]
    requests, results = topics(kafka_settings).requests(MODEL), topics(kafka_settings).results(MODEL)
    config = tmp_path / "batchtide.toml"
    config.write_text(
        f"""
[kafka]
bootstrap_servers = "{kafka_settings.bootstrap_servers}"
topic_prefix = "{kafka_settings.topic_prefix}"

[consumer]
group_type = "share"
lag_interval_ms = 0
fleet_beacon_ms = 0

[models.{MODEL}]
runner = "cost-model"
cost_a_ms = 5000.0
cost_c_ms = 0.0
partitions = 1
target_size = 64
max_wait_ms = 1
"""
    )
    fast = cost_model(a_ms=5.0, c_ms=0.5, partitions=1, target_size=8, max_wait_ms=1)
    log = tmp_path / "victim.log"

    async def scenario() -> None:
        await create_topics(kafka_settings, fast)
        await prepare_share_group(kafka_settings, group(kafka_settings))
        await set_group_config(kafka_settings, group(kafka_settings), share_record_lock_duration_ms=15000)
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        argv = [sys.executable, "-m", "pipeline.cli", "consume", "--model", MODEL, "--config", str(config)]
        victim = subprocess.Popen(
            [*argv, "--consumer-id", "victim"], env=env, stdout=subprocess.DEVNULL, stderr=log.open("w")
        )
        try:
            await send(kafka_settings, requests, wanted, partition=0)
            await _wait_for(lambda: share_lag(kafka_settings, 1), lambda got: got == [len(wanted)], 30)
            deadline = time.monotonic() + 60
            while (
                victim.poll() is None and not await _assigned(kafka_settings, "victim") and time.monotonic() < deadline
            ):
                await asyncio.sleep(0.2)
            await asyncio.sleep(2.0)  # the victim took the records into a 5 s batch
            assert victim.poll() is None, _read(log)
            assert await share_lag(kafka_settings, 1) == [len(wanted)]
        finally:
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
        killed_at = time.monotonic()
        async with running(make_consumer(fast, kafka_settings, SHARE, "fast")) as rescuer:
            answers = await collect(kafka_settings, results, {r["id"] for r in wanted}, timeout_s=90)
        waited = time.monotonic() - killed_at
        assert set(answers.by_id) == {r["id"] for r in wanted}
        assert _past_dedup(answers) == {}
        assert sum(rescuer.stats.answered.values()) == len(wanted)
        assert rescuer.stats.share_redelivered > 0, "the victim held nothing when it was killed"
        assert waited < 60, f"records came back {waited:.0f} s after the kill"

    asyncio.run(scenario())


async def _assigned(kafka: KafkaSettings, consumer_id: str) -> bool:
    """Whether a share member of `consumer_id` has partitions (the broker hands them on a heartbeat)."""
    async with LagProbe(kafka) as probe:
        view = await probe.describe_share_group(group(kafka))
    return any(m.partitions for m in view.members if m.client_id.startswith(f"{consumer_id}#"))


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


async def _wait_for(read, done, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        got = await read()
        if done(got) or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.2)


def test_an_unreadable_record_goes_to_the_dead_letter_topic_and_is_rejected(kafka_settings: KafkaSettings) -> None:
    model = cost_model(partitions=1, target_size=4, max_wait_ms=1)
    good = [request(i) for i in range(10)]
    requests, dlq = topics(kafka_settings).requests(MODEL), topics(kafka_settings).dlq

    async def scenario() -> None:
        await create_topics(kafka_settings, model)
        consumer = make_consumer(model, kafka_settings, SHARE)
        async with running(consumer):
            await send(kafka_settings, requests, [b"{not json", *good], partition=0)
            await collect(kafka_settings, topics(kafka_settings).results(MODEL), {r["id"] for r in good})
            letters: list[dict[str, object]] = []
            async with TopicReader(kafka_settings, dlq) as reader:
                await reader.read(lambda r: letters.append(json.loads(r.value)), limit=1, timeout_s=20)
            lag = await _wait_for(lambda: share_lag(kafka_settings, 1), lambda got: got == [0], 20)
        assert letters and letters[0]["reason"] == "invalid_json"
        assert consumer.stats.share_rejected == 1
        assert lag == [0]

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_broker_without_share_groups_is_refused_at_start_with_a_plain_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kafka 3.9, the oldest broker batchtide supports, has no share groups."""
    from pipeline.tools.devtools.localkafka import LocalKafka

    monkeypatch.setenv("BATCHTIDE_KAFKA_VERSION", "3.9.1")
    broker = LocalKafka(tmp_path / "kafka-3.9")
    broker.start(timeout_s=120)
    try:
        kafka = KafkaSettings(bootstrap_servers=broker.bootstrap, topic_prefix="old")
        consumer = make_consumer(cost_model(partitions=1), kafka, SHARE)
        with pytest.raises(ShareGroupsUnavailable, match=r"Apache Kafka 4\.2 or newer"):
            asyncio.run(consumer.start())
    finally:
        broker.stop()
