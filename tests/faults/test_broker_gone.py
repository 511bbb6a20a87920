"""The broker dies under a busy consumer: SIGTERM still ends it, within its stop budget.

aiokafka's stop() can wait forever for a broker that is gone (a producer
flushes, a consumer looks for its coordinator) and can raise the cancellation
of its own fetch tasks; a consumer that Kubernetes or an operator asks to stop
must exit anyway, cleanly and on time, and a second SIGTERM must end it at once.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import Topics, ensure_topics
from pipeline.tools.chaos.deployment import Stage
from pipeline.tools.harness.config_file import kafka_table, toml_text
from pipeline.tools.harness.processes import Proc, consume_argv
from tests.support.kafka import consume_n, json_values, produce_json

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

MODEL = "m"
REQUESTS = 400
STOP_TIMEOUT_S = 6.0


def _consumer(stage: Stage, name: str, stop_timeout_s: float) -> Proc:
    """A real `consume` process; ~100 ms batches of 8, so 400 requests keep it busy for seconds."""
    config = stage.workdir / f"{name}.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        toml_text(
            {
                "kafka": kafka_table(stage.kafka),
                "consumer": {"stop_timeout_s": stop_timeout_s},
                f"models.{MODEL}": {
                    "runner": "cost-model",
                    "cost_a_ms": 100.0,
                    "cost_c_ms": 1.0,
                    "hard_cap": 8,
                    "adaptive_cap": False,
                    "partitions": 4,
                },
            }
        )
    )
    return Proc(name, consume_argv(MODEL, config, name, "--no-create-topics"), stage.workdir)


def _exit_within(proc: Proc, timeout_s: float) -> tuple[int | None, float]:
    started = time.monotonic()
    code = proc.wait(timeout_s)
    return code, time.monotonic() - started


async def _busy(settings: KafkaSettings) -> None:
    """Requests queued for both consumers, and answers already flowing."""
    topics = Topics(settings.topic_prefix)
    await ensure_topics(settings, {MODEL: 4})
    requests = ({"id": f"r{i}", "model": MODEL, "text": f"request {i}"} for i in range(REQUESTS))
    await produce_json(settings, topics.requests(MODEL), requests, key=lambda v: v["id"])


async def _both_answering(settings: KafkaSettings) -> None:
    """Until each consumer has answered a request: both hold partitions, and work, when the broker dies."""
    results = Topics(settings.topic_prefix).results(MODEL)
    for n in range(20, REQUESTS, 20):
        answered_by = {
            value["consumer_id"] for value in json_values(await consume_n(settings, results, n, timeout_s=60))
        }
        if answered_by == {"patient", "stubborn"}:
            return
    raise AssertionError(f"only {answered_by} answered")


@pytest.mark.timeout(180)
def test_sigterm_ends_a_busy_consumer_whose_broker_died(own_broker_stage: Stage) -> None:
    stage = own_broker_stage
    broker = stage.broker
    assert broker is not None
    asyncio.run(_busy(stage.kafka))
    patient = _consumer(stage, "patient", stop_timeout_s=STOP_TIMEOUT_S)
    stubborn = _consumer(stage, "stubborn", stop_timeout_s=300.0)
    try:
        patient.start()
        stubborn.start()
        asyncio.run(_both_answering(stage.kafka))
        broker.kill()
        assert patient.alive and stubborn.alive, "the consumers must ride out the broker's death until told to stop"

        patient.request_stop()
        stubborn.request_stop()
        code, took = _exit_within(patient, STOP_TIMEOUT_S + 10)
        assert code == 0, f"exit code {code} after {took:.1f} s:\n{patient.log_tail(40)}"
        # the stop budget, the lag recorder's 2 s and the runner's close
        assert took <= STOP_TIMEOUT_S + 5, f"a clean stop took {took:.1f} s with a {STOP_TIMEOUT_S:g} s budget"
        log = patient.log_path.read_text(errors="replace")
        assert "Traceback" not in log, patient.log_tail(40)

        assert stubborn.alive, "with a 300 s budget and work it cannot publish, the first SIGTERM drains"
        stubborn.request_stop()
        code, took = _exit_within(stubborn, 5.0)
        assert code == 128 + signal.SIGTERM, f"exit code {code} after {took:.1f} s:\n{stubborn.log_tail(40)}"
        assert "second SIGTERM: exiting now" in stubborn.log_path.read_text(errors="replace")
    finally:
        patient.kill()
        stubborn.kill()
