"""`batchtide local up|status|down` and `batchtide topics create` against real brokers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from pipeline.core.config import KafkaSettings
from pipeline.tools.commands import local, topics
from pipeline.tools.devtools.localkafka import LocalKafka, free_port, kafka_version, port_is_free


def _app() -> typer.Typer:
    app = typer.Typer()
    local.register(app)
    topics.register(app)
    return app


@pytest.mark.kafka
def test_local_up_status_down_with_a_detached_broker(tmp_path: Path) -> None:
    runner, app, data_dir, port = CliRunner(), _app(), tmp_path / "kafka", free_port()
    try:
        up = runner.invoke(app, ["local", "up", "--data-dir", str(data_dir), "--port", str(port)])
        assert up.exit_code == 0, up.output
        assert f"BATCHTIDE_KAFKA_BOOTSTRAP=127.0.0.1:{port}" in up.output
        assert f"Apache Kafka {kafka_version()} up in" in up.output
        state = json.loads((data_dir / "state.json").read_text())
        assert state["bootstrap"] == f"127.0.0.1:{port}"

        again = runner.invoke(app, ["local", "up", "--data-dir", str(data_dir)])
        assert again.exit_code == 0 and "already running" in again.output

        created = runner.invoke(
            app, ["topics", "create", "--bootstrap", f"127.0.0.1:{port}", "--model", "demo", "--partitions", "2"]
        )
        assert created.exit_code == 0, created.output
        status = runner.invoke(app, ["local", "status", "--data-dir", str(data_dir)])
        assert status.exit_code == 0, status.output
        assert "batchtide.requests.demo  partitions=2" in status.output
        assert "batchtide.dlq  partitions=4" in status.output
        assert f"running: Apache Kafka {kafka_version()}," in status.output

        down = runner.invoke(app, ["local", "down", "--data-dir", str(data_dir)])
        assert down.exit_code == 0 and "stopped pid" in down.output
        assert port_is_free(port)
        stopped = runner.invoke(app, ["local", "status", "--data-dir", str(data_dir)])
        assert stopped.exit_code == 3 and "not running" in stopped.output
    finally:
        LocalKafka(data_dir).stop()


@pytest.mark.kafka
def test_topics_create_reads_models_and_partitions_from_config(tmp_path: Path, kafka_settings: KafkaSettings) -> None:
    config = tmp_path / "batchtide.toml"
    config.write_text(
        f'[models.alpha]\nrunner = "zero-cost"\npartitions = 3\n\n'
        f'[kafka]\nbootstrap_servers = "{kafka_settings.bootstrap_servers}"\n'
        f'topic_prefix = "{kafka_settings.topic_prefix}"\nevents_partitions = 1\n'
    )
    result = CliRunner().invoke(_app(), ["topics", "create", "--config", str(config)])
    assert result.exit_code == 0, result.output
    p = kafka_settings.topic_prefix
    for line in (
        f"{p}.requests.alpha  partitions=3",
        f"{p}.requests.alpha.priority  partitions=3",
        f"{p}.results.alpha  partitions=3",
        f"{p}.events.latency  partitions=1",
        f"{p}.events.batches  partitions=1",
        f"{p}.events.lag  partitions=1",
        f"{p}.dlq  partitions=1",
    ):
        assert line in result.output


def test_topics_create_without_models_is_an_error() -> None:
    result = CliRunner().invoke(_app(), ["topics", "create"])
    assert result.exit_code == 1
    assert "no models" in result.output


@pytest.mark.kafka
def test_local_up_brokers_3_replicates_topics_and_status_shows_leaders_and_isr(tmp_path: Path) -> None:
    """A KRaft quorum of three detached nodes; topics get 3 replicas and min.insync.replicas 2; down stops all."""
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    from pipeline.tools.devtools.localcluster import LocalCluster

    runner, app, data_dir = CliRunner(), _app(), tmp_path / "cluster"
    cluster = LocalCluster(data_dir, brokers=3)
    try:
        up = runner.invoke(app, ["local", "up", "--brokers", "3", "--data-dir", str(data_dir)])
        assert up.exit_code == 0, up.output
        cluster = LocalCluster.open(data_dir)
        pids = [node.pid for node in cluster.nodes]
        assert all(pids) and len(set(pids)) == 3
        assert f"BATCHTIDE_KAFKA_BOOTSTRAP={cluster.bootstrap}" in up.output
        created = runner.invoke(app, ["topics", "create", "--bootstrap", cluster.bootstrap, "--model", "demo"])
        assert created.exit_code == 0, created.output

        async def min_isr() -> str:
            admin = AIOKafkaAdminClient(bootstrap_servers=cluster.bootstrap)
            await admin.start()
            try:
                resource = ConfigResource(
                    ConfigResourceType.TOPIC, "batchtide.results.demo", {"min.insync.replicas": None}
                )
                response = (await admin.describe_configs([resource]))[0]
            finally:
                await admin.close()
            entries = {entry[0]: entry[1] for entry in response.resources[0][4]}
            return str(entries.get("min.insync.replicas", response.resources))

        deadline = time.monotonic() + 15
        found = asyncio.run(min_isr())
        while found != "2" and time.monotonic() < deadline:  # every broker learns of a new topic in its own time
            time.sleep(0.2)
            found = asyncio.run(min_isr())
        assert found == "2"
        status = runner.invoke(app, ["local", "status", "--data-dir", str(data_dir)])
        assert status.exit_code == 0, status.output
        assert "controller leader: node " in status.output and "voters [1, 2, 3]" in status.output
        for node_id in (1, 2, 3):
            assert f"broker {node_id}: running" in status.output
        lines = [line for line in status.output.splitlines() if line.strip().startswith("p0 ")]
        assert len(lines) == 8, status.output  # the model's 3 topics, 4 event/DLQ topics, the fleet
        assert all("replicas=[" in line and line.count(",") >= 4 for line in lines), status.output

        down = runner.invoke(app, ["local", "down", "--data-dir", str(data_dir)])
        assert down.exit_code == 0 and all(str(pid) in down.output for pid in pids), down.output
        assert not any(node.is_running for node in cluster.nodes)
        stopped = runner.invoke(app, ["local", "status", "--data-dir", str(data_dir)])
        assert stopped.exit_code == 3 and "not running" in stopped.output
    finally:
        cluster.kill()
