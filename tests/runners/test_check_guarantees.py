"""Property: whatever valid Request check() accepts, run() can compute (tiny real models).

check() is the runner's promise to the loop: a request it passes must not
need poison isolation. Hypothesis feeds any Unicode text (control chars, NUL,
emoji, empty) and any in-schema token ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers.runners import make_runner
from consumers.runners.transformers_runner import TransformersRunner
from pipeline.core.config import ModelConfig
from schemas.messages import GenerationParams, Request

pytestmark = pytest.mark.model

PROPERTY = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
inputs = st.one_of(
    st.builds(lambda t: {"text": t}, st.text(max_size=300)),
    st.builds(lambda ids: {"token_ids": ids}, st.lists(st.integers(0, 2**31 - 1), max_size=40)),
    st.builds(lambda ids: {"token_ids": ids}, st.lists(st.integers(0, 450), max_size=200)),
)


@pytest.fixture(scope="module")
def tiny_runners(tiny_bert_dir: Path, tiny_gpt2_dir: Path) -> list[TransformersRunner]:
    runners = [
        make_runner(ModelConfig(name="m", model_path=str(tiny_bert_dir), max_input_tokens=100)),
        make_runner(ModelConfig(name="m", model_path=str(tiny_gpt2_dir), max_new_tokens=3)),
    ]
    for r in runners:
        r.load()
    return runners  # type: ignore[return-value]


@PROPERTY
@given(st.lists(inputs, min_size=1, max_size=4))
def test_accepted_requests_always_run(tiny_runners: list[TransformersRunner], batch: list[dict[str, object]]) -> None:
    assert tiny_runners
    for runner in tiny_runners:
        reqs = [
            Request(id=f"h{i}", model="m", params=GenerationParams(max_new_tokens=2), **fields)  # type: ignore[arg-type]
            for i, fields in enumerate(batch)
        ]
        accepted = [r for r in reqs if runner.check(r) is None]
        for r in reqs:
            tokens_in, _ = runner.measure(r)
            assert (r in accepted) == (
                0 < tokens_in <= runner.max_input_tokens and _in_vocab(runner, r) and not _blank_prompt(runner, r)
            )
        if accepted:
            outputs = runner.run(accepted)
            assert len(outputs) == len(accepted)


def _blank_prompt(runner: TransformersRunner, req: Request) -> bool:
    """A generation prompt of whitespace only is refused even when the tokenizer makes tokens of it."""
    return runner.task == "generate" and req.token_ids is None and not (req.text or "").strip()


def _in_vocab(runner: TransformersRunner, req: Request) -> bool:
    return req.token_ids is None or max(req.token_ids, default=0) < runner._vocab_size
