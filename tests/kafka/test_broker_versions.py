"""The local broker runs the Kafka release it is asked for, and from 4.2 it serves share groups.

The session broker runs `kafka_version()` (BATCHTIDE_KAFKA_VERSION, else the
default); these tests check that the jars on its classpath are that release,
that a data dir refuses an older release than the one that last ran it, and,
on 4.2 or newer, that a share group (KIP-932) delivers records with the
client that has one (confluent-kafka's ShareConsumer).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import create_topics
from pipeline.tools.devtools.broker_config import write_identity
from pipeline.tools.devtools.kafka_jars import (
    DEFAULT_KAFKA_VERSION,
    KafkaSetupError,
    kafka_version,
    parse_version,
    supports_share_groups,
)
from pipeline.tools.devtools.localkafka import LocalKafka
from tests.support.kafka import consume_n, json_values, produce_json

OLDEST = "3.9.1"
"""The oldest release the suite runs on (Makefile KAFKA_OLDEST)."""


@pytest.mark.kafka
def test_the_broker_runs_the_selected_release(kafka_broker: LocalKafka) -> None:
    assert kafka_broker.kafka_version == kafka_version()
    command = Path(f"/proc/{kafka_broker.pid}/cmdline").read_bytes().split(b"\0")
    classpath = command[command.index(b"-cp") + 1].decode()
    assert classpath.endswith(f"kafka-{kafka_broker.kafka_version}/libs/*")
    assert (Path(classpath[:-1]) / f"kafka_2.13-{kafka_broker.kafka_version}.jar").is_file()
    assert json.loads((kafka_broker.data_dir / "cluster.json").read_text())["kafka_version"] == kafka_version()


def test_version_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHTIDE_KAFKA_VERSION", raising=False)
    assert kafka_version() == DEFAULT_KAFKA_VERSION
    assert parse_version(DEFAULT_KAFKA_VERSION) >= (4, 2, 0)
    monkeypatch.setenv("BATCHTIDE_KAFKA_VERSION", "3.9.1")
    assert kafka_version() == "3.9.1"
    assert not supports_share_groups("3.9.1") and not supports_share_groups("4.1.2")
    assert supports_share_groups("4.2.0") and supports_share_groups(DEFAULT_KAFKA_VERSION)
    for wrong in ("3.8.1", "4.2", "latest"):
        monkeypatch.setenv("BATCHTIDE_KAFKA_VERSION", wrong)
        with pytest.raises(KafkaSetupError):
            kafka_version()


def test_a_data_dir_never_goes_back_to_an_older_release(tmp_path: Path) -> None:
    identity = write_identity(tmp_path, tmp_path / "cluster.json", None, None, {}, False, "4.2.0")
    assert identity["kafka_version"] == "4.2.0"
    with pytest.raises(KafkaSetupError, match=r"3\.9\.1 cannot read"):
        write_identity(tmp_path, tmp_path / "cluster.json", identity, None, {}, False, "3.9.1")
    upgraded = write_identity(tmp_path, tmp_path / "cluster.json", identity, None, {}, False, "4.4.0")
    assert upgraded["kafka_version"] == "4.4.0"
    made_before_versions = {k: v for k, v in identity.items() if k != "kafka_version"}
    with pytest.raises(KafkaSetupError, match=r"run by Apache Kafka 3\.9\.1"):
        write_identity(tmp_path, tmp_path / "cluster.json", made_before_versions, None, {}, False, "3.9.0")


@pytest.mark.kafka
def test_a_data_dir_of_the_oldest_release_comes_up_on_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A var/kafka made by 3.9.1 keeps its topics, records and committed offsets on 4.x."""
    topic, group, values = "kept", "kept-group", [{"n": n} for n in range(10)]
    monkeypatch.setenv("BATCHTIDE_KAFKA_VERSION", OLDEST)
    old = LocalKafka(tmp_path)
    old.start(timeout_s=120)
    settings = KafkaSettings(bootstrap_servers=old.bootstrap)

    async def before() -> None:
        await create_topics(settings, {topic: 1})
        await produce_json(settings, topic, values)
        assert json_values(await consume_n(settings, topic, 6, group_id=group)) == values[:6]

    try:
        asyncio.run(before())
    finally:
        old.stop()
    monkeypatch.setenv("BATCHTIDE_KAFKA_VERSION", DEFAULT_KAFKA_VERSION)
    new = LocalKafka(tmp_path)
    new.start(timeout_s=120)
    try:
        rest = asyncio.run(consume_n(settings, topic, 4, group_id=group))
        assert json_values(rest) == values[6:], "the group resumes from the offset 3.9.1 committed"
        assert new.recorded_version == DEFAULT_KAFKA_VERSION
    finally:
        new.stop()
    monkeypatch.setenv("BATCHTIDE_KAFKA_VERSION", OLDEST)
    with pytest.raises(KafkaSetupError, match="cannot read"):
        LocalKafka(tmp_path).start(timeout_s=120)


@pytest.mark.kafka
def test_share_groups_deliver_each_record_once(kafka_broker: LocalKafka, kafka_settings: KafkaSettings) -> None:
    """Two members of one share group on ONE partition: every record reaches exactly one of them."""
    if not supports_share_groups(kafka_broker.kafka_version):
        pytest.skip(f"share groups need Kafka 4.2; this broker is {kafka_broker.kafka_version}")
    from confluent_kafka import ShareConsumer

    topic = f"{kafka_settings.topic_prefix}.shared"
    group = f"{kafka_settings.topic_prefix}.share-group"
    values = [{"n": n} for n in range(40)]
    asyncio.run(create_topics(kafka_settings, {topic: 1}))
    admin = AdminClient({"bootstrap.servers": kafka_settings.bootstrap_servers})
    # A share group starts at the log end unless told otherwise; a group config, set before it exists.
    reset = ConfigEntry("share.auto.offset.reset", "earliest", incremental_operation=AlterConfigOpType.SET)
    for future in admin.incremental_alter_configs(
        [ConfigResource(ResourceType.GROUP, group, incremental_configs=[reset])]
    ).values():
        future.result(timeout=30)
    asyncio.run(produce_json(kafka_settings, topic, values))

    config = {"bootstrap.servers": kafka_settings.bootstrap_servers, "group.id": group}
    members = [ShareConsumer(config), ShareConsumer(config)]
    seen: list[tuple[int, int]] = []
    try:
        for member in members:
            member.subscribe([topic])
        deadline = time.monotonic() + 60
        while len(seen) < len(values) and time.monotonic() < deadline:
            for index, member in enumerate(members):
                for message in member.poll(0.5) or []:
                    value = message.value()
                    if message.error() is None and value is not None:
                        seen.append((index, json.loads(value)["n"]))
    except KafkaException as e:
        pytest.fail(f"share consumer failed: {e!r}")
    finally:
        for member in members:
            member.close()
    assert sorted(n for _, n in seen) == [v["n"] for v in values], "each record once, none lost"
