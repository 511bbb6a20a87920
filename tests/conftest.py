"""Shared test set-up. Services (Kafka broker, ClickHouse engine, tiny models)
are started by the fixtures in tests/support/, never by hand.

A test that starts a Kafka broker carries the `kafka` mark and one that loads a
transformers model (tiny or real) the `model` mark: `make check` leaves both out
to stay fast. The hooks below keep the marks true: an unmarked test that asks for
a broker or model fixture fails before the fixture starts anything, and one that
starts a broker or loads a model some other way fails when it tries.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = [
    "tests.support.kafka",
    "tests.support.clickhouse",
    "tests.support.models",
    "tests.support.fleet_store",
]

BROKER_FIXTURES = frozenset(
    {"kafka_broker", "sasl_kafka_broker", "tls_kafka_broker", "own_broker_stage", "cluster_stage"}
)
"""Fixtures that start a broker (directly or through the ones they use)."""
MODEL_FIXTURES = frozenset({"tiny_bert_dir", "tiny_gpt2_dir", "tiny_llama_dir"})
"""Fixtures that build a transformers model (every test using one loads it)."""


def _unmarked(item: pytest.Item, mark: str, fixtures: frozenset[str]) -> str | None:
    """The first of `fixtures` an item uses without carrying `mark`, or None."""
    if item.get_closest_marker(mark) is not None:
        return None
    used = sorted(fixtures.intersection(getattr(item, "fixturenames", ())))
    return used[0] if used else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail an unmarked test that asks for a broker or a model, before its fixtures run."""
    for mark, fixtures, what in (("kafka", BROKER_FIXTURES, "a Kafka broker"), ("model", MODEL_FIXTURES, "a model")):
        fixture = _unmarked(item, mark, fixtures)
        if fixture is not None:
            pytest.fail(
                f"{item.nodeid} uses {fixture}, which starts {what}, but is not marked `{mark}`: add "
                f"@pytest.mark.{mark} (or `pytestmark = pytest.mark.{mark}`) so `make check` leaves it out",
                pytrace=False,
            )


@pytest.fixture(autouse=True)
def _services_need_their_mark(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An unmarked test that starts a broker or loads a model without a fixture fails when it does."""
    node = request.node

    def refuse(mark: str, what: str) -> object:
        def refused(*_args: object, **_kwargs: object) -> None:
            pytest.fail(f"{node.nodeid} {what} but is not marked `{mark}`: add @pytest.mark.{mark}", pytrace=False)

        return refused

    if node.get_closest_marker("kafka") is None:
        from pipeline.tools.devtools.localcluster import LocalCluster
        from pipeline.tools.devtools.localkafka import LocalKafka

        monkeypatch.setattr(LocalKafka, "start", refuse("kafka", "starts a Kafka broker"))
        monkeypatch.setattr(LocalCluster, "start", refuse("kafka", "starts a Kafka cluster"))
    if node.get_closest_marker("model") is None:
        from consumers.runners.transformers_runner import TransformersRunner
        from tests.support import models

        monkeypatch.setattr(TransformersRunner, "_load", refuse("model", "loads a transformers model"))
        monkeypatch.setattr(models, "_save", refuse("model", "builds a transformers model"))
    yield
