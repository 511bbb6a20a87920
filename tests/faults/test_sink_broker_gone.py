"""The broker dies under a running sink: SIGTERM still ends it, within its stop budget.

faust runs its Kafka consumer in a thread of its own, and mode waits a fixed
60 s for that thread to stop, then prints a TimeoutError's traceback. A sink
that an operator or Kubernetes asks to stop must exit within
`[clickhouse] sink_stop_timeout_s`, cleanly, whatever the broker is doing.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from pipeline.tools.chaos.deployment import CostModelDevice, Deployment, Stage

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

STOP_TIMEOUT_S = 6.0
MARGIN_S = 4.0
"""Interpreter exit and the embedded ClickHouse's close, after the budget."""


async def _sink_under_load(stage: Stage) -> tuple[Deployment, float]:
    deployment = Deployment(stage, CostModelDevice(), clickhouse={"sink_stop_timeout_s": STOP_TIMEOUT_S})
    await deployment.__aenter__()
    deployment.consumer("c1")
    sink = deployment.sink()
    await deployment.warm_up()
    await deployment.sink_ready(90)
    assert sink.alive
    # the harness's own clients leave before the broker goes; the consumer keeps producing events
    await deployment.traffic.stop()
    await deployment.collector.stop()
    return deployment, time.monotonic()


@pytest.mark.timeout(240)
def test_sigterm_ends_a_sink_whose_broker_died(own_broker_stage: Stage) -> None:
    stage = own_broker_stage
    assert stage.broker is not None
    loop = asyncio.new_event_loop()
    deployment, _ = loop.run_until_complete(_sink_under_load(stage))
    (sink,) = deployment.sinks
    try:
        stage.broker.kill()
        time.sleep(2.0)
        assert sink.alive, "the sink must ride out the broker's death until told to stop"
        sink.request_stop()
        started = time.monotonic()
        code = sink.wait(STOP_TIMEOUT_S + MARGIN_S + 60)
        took = time.monotonic() - started
        assert code == 0, f"exit code {code} after {took:.1f} s:\n{sink.log_tail(40)}"
        assert took <= STOP_TIMEOUT_S + MARGIN_S, (
            f"the sink took {took:.1f} s to stop with a {STOP_TIMEOUT_S:g} s budget"
        )
        log = sink.log_path.read_text(errors="replace")
        assert "Traceback" not in log, sink.log_tail(60)
    finally:
        for proc in [*deployment.consumers.values(), *deployment.sinks]:
            proc.kill()
        loop.close()
