"""`bench pipeline` on the session broker: a short real run answers everything and accounts for its time."""

from __future__ import annotations

import asyncio

from pipeline.bench.pipeline import STAGES, BenchOptions, run_bench
from pipeline.config import KafkaSettings


def test_a_short_run_answers_every_request_and_breaks_its_latency_down(kafka_settings: KafkaSettings) -> None:
    options = BenchOptions(
        runner="cost-model", rates=(40.0,), duration_s=3.0, cost_a_ms=4.0, cost_c_ms=1.0,
        bootstrap=kafka_settings.bootstrap_servers, partitions=2, tokens=10,
    )
    lines: list[str] = []
    figures = asyncio.run(run_bench(options, find_max_mode=False, rates_mode=True, say=lines.append))

    (trial,) = figures["model_trials"]
    assert trial["sent"] > 60 and trial["answered"] == trial["sent"]
    assert set(figures["model_p99_ms"]) == {"40"}
    assert 0 < figures["model_p50_ms"]["40"] <= figures["model_p99_ms"]["40"] <= figures["model_p999_ms"]["40"]
    assert figures["model_tokens_per_s"] > 0
    assert trial["mean_batch"] >= 1.0
    # the device sleeps 4 + 1*b ms per batch: the consumer's compute stamps see it
    assert trial["stages_p50_ms"]["compute"] >= 4.0
    assert set(trial["stages_p50_ms"]) == set(STAGES) == set(trial["stages_p99_ms"])
    for name in STAGES:
        assert 0 <= trial["stages_p50_ms"][name] <= trial["stages_p99_ms"][name] <= trial["max_ms"] + 1
    # the stages are consecutive spans of one request's life: their medians cannot add up past its worst end to end
    assert sum(trial["stages_p50_ms"].values()) <= trial["max_ms"] + len(STAGES)
    assert trial["consumer_cpu_ms_per_request"] > 0
    assert any("stage p50/p99 ms: kafka_in" in line for line in lines)
