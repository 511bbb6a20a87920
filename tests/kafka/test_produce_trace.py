"""`batchtide produce --trace`: a trace's slice sent to a real broker, prompts of its exact token
counts with the model's tokenizer, answers forced to its lengths, each request with its trace index."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from consumers.runners import make_runner
from pipeline.cli import app
from pipeline.core.config import KafkaSettings, load_config
from pipeline.core.kafka.client import Topics
from pipeline.core.sim.generation.trace import write_trace
from pipeline.tools.devtools.trace_load import PromptError, exact_prompt
from schemas.messages import Request
from tests.support.kafka import consume_n

MODEL = "gen"


def _config(tmp_path: Path, kafka: KafkaSettings, model_dir: Path) -> Path:
    path = tmp_path / "batchtide.toml"
    path.write_text(
        f'[models.{MODEL}]\nrunner = "transformers"\nmodel_path = "{model_dir}"\ntask = "generate"\n'
        "max_input_tokens = 90\nmax_new_tokens = 20\npartitions = 2\n\n"
        f'[kafka]\nbootstrap_servers = "{kafka.bootstrap_servers}"\ntopic_prefix = "{kafka.topic_prefix}"\n'
    )
    return path


@pytest.mark.model
@pytest.mark.kafka
def test_a_trace_slice_reaches_the_topic_with_exact_prompts_forced_answers_and_indices(
    kafka_settings: KafkaSettings, tiny_gpt2_dir: Path, tmp_path: Path
) -> None:
    config = _config(tmp_path, kafka_settings, tiny_gpt2_dir)
    prompts = np.array([1, 7, 33, 64, 90, 12, 5, 48])
    answers = np.array([1, 20, 3, 9, 14, 2, 6, 11])
    offsets = np.array([0.0, 0.4, 0.4, 0.5, 2.0, 2.1, 9.0, 9.5])  # seconds
    trace = write_trace(tmp_path / "t.csv", offsets, prompts, answers)
    # trace seconds 0.3..2.05 (rows 1-4), at a tenth of the time
    args = ["produce", "--trace", str(trace), "--model", MODEL, "--config", str(config)]
    out = CliRunner().invoke(app, [*args, "--start", "0.3", "--window", "1.75", "--time-scale", "0.1"])
    assert out.exit_code == 0, out.output
    assert "4 requests" in out.output and "sent 4 requests" in out.output
    records = asyncio.run(consume_n(kafka_settings, Topics(kafka_settings.topic_prefix).requests(MODEL), 4))
    sent = [json.loads(r.value) for r in records]
    runner = make_runner(load_config(config).model(MODEL), weights=False)
    runner.load()
    by_index = {r["trace_index"]: r for r in sent}
    assert sorted(by_index) == [1, 2, 3, 4]
    for index, body in by_index.items():
        request = Request(id=body["id"], model=MODEL, text=body["text"])
        assert runner.measure(request)[0] == prompts[index], "the prompt is exactly the trace's tokens"
        assert body["params"] == {"max_new_tokens": int(answers[index]), "ignore_eos": True}


@pytest.mark.model
@pytest.mark.kafka
def test_requests_the_model_would_refuse_and_bad_files_stop_produce_before_sending(
    kafka_settings: KafkaSettings, tiny_gpt2_dir: Path, tmp_path: Path
) -> None:
    config = _config(tmp_path, kafka_settings, tiny_gpt2_dir)
    trace = write_trace(tmp_path / "t.csv", np.array([0.0, 1.0, 2.0]), np.array([10, 200, 10]), np.array([5, 5, 40]))
    args = ["produce", "--trace", str(trace), "--model", MODEL, "--config", str(config)]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2
    assert "would refuse 2 of the 3 requests" in refused.output and "trace index 1" in refused.output
    assert "--length-scale" in refused.output
    shorter = CliRunner().invoke(app, [*args, "--length-scale", "0.4", "--window", "1.5"])  # 4 and 80 tokens fit
    assert "would refuse" not in shorter.output
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,12,x\n")
    out = CliRunner().invoke(app, ["produce", "--trace", str(bad), "--model", MODEL, "--config", str(config)])
    assert out.exit_code == 2 and "line 2: answer tokens 'x' is not a whole number" in out.output
    unknown = CliRunner().invoke(app, ["produce", "--trace", str(trace), "--model", "nope", "--config", str(config)])
    assert unknown.exit_code == 2 and "needs model 'nope' in the config" in unknown.output


def test_exact_prompts_meet_a_tokenizer_whose_words_are_several_tokens() -> None:
    """Words of 1-3 tokens and a filler of one: every count is met exactly, or refused."""

    def count(text: str) -> int:
        return sum(len(word) // 4 + 1 for word in text.split())

    words = ["river", "a", "stonewalling", "queue"] * 50
    for tokens in range(1, 60):
        assert count(exact_prompt(tokens, count, words)) == tokens
    with pytest.raises(PromptError):
        exact_prompt(5, lambda text: 2 * len(text.split()), ["ab"] * 10)  # only even counts exist


def test_a_slice_is_sent_from_its_first_request_not_from_its_window_start() -> None:
    """A window that opens 10 s (trace time) before its first request sends that request at once: an
    idle lead-in would stretch the load's duration, and a live run's tokens/s over it, but not the
    simulated run's, which counts from the first arrival."""
    from pipeline.core.sim.generation.trace import Trace, TraceSlice
    from pipeline.tools.devtools.trace_load import trace_load

    offsets = np.array([0.0, 5.0, 50.0, 50.4, 52.0]) * 1000.0
    trace = Trace("t", np.arange(5), offsets, np.full(5, 8), np.full(5, 4))
    sliced = TraceSlice(time_scale=2.0, start_s=40.0, duration_s=20.0).apply(trace)
    load = trace_load(sliced, ["a b c"] * len(sliced))
    assert load.send_ms.tolist() == pytest.approx([0.0, 800.0, 4000.0])
    assert load.duration_s == pytest.approx(sliced.span_s) == pytest.approx(4.0)
    assert load.trace_index is not None and load.trace_index.tolist() == [2, 3, 4]
