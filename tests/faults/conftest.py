"""Fixtures of the fault suite: a Stage per test on the real broker.

Scenarios that only kill consumers or the sink share the session broker
(each test has its own topic prefix). A scenario that stops the broker gets
a broker of its own, so no other test ever sees it go away.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.core.config import KafkaSettings
from pipeline.tools.chaos.deployment import Stage
from pipeline.tools.devtools.localcluster import LocalCluster
from pipeline.tools.devtools.localkafka import LocalKafka
from tests.support.kafka import unique_prefix


@pytest.fixture
def stage(kafka_settings: KafkaSettings, tmp_path: Path) -> Stage:
    return Stage(workdir=tmp_path, kafka=kafka_settings)


@pytest.fixture
def own_broker_stage(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stage]:
    """A broker only this test uses: it may be stopped, killed and restarted at will."""
    broker = LocalKafka(tmp_path / "kafka")
    broker.start(timeout_s=90)
    try:
        settings = KafkaSettings(bootstrap_servers=broker.bootstrap, topic_prefix=unique_prefix(request.node.name))
        yield Stage(workdir=tmp_path / "stage", kafka=settings, broker=broker)
    finally:
        broker.stop()


@pytest.fixture
def cluster_stage(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stage]:
    """A three-broker cluster only this test uses (the code `batchtide local up --brokers 3` runs)."""
    cluster = LocalCluster(tmp_path / "cluster", brokers=3)
    cluster.start(timeout_s=180)
    try:
        settings = KafkaSettings(bootstrap_servers=cluster.bootstrap, topic_prefix=unique_prefix(request.node.name))
        yield Stage(workdir=tmp_path / "stage", kafka=settings, cluster=cluster)
    finally:
        cluster.stop()
