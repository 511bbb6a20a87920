"""Shared test set-up. Services (Kafka broker, ClickHouse engine, tiny models)
are started by the fixtures in tests/support/, never by hand."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = [
    "tests.support.kafka",
    "tests.support.clickhouse",
    "tests.support.models",
    "tests.support.fleet_store",
]
