"""Prompt and output length mixes of `bench pipeline --runner smollm`.

Real LLM traffic is long-tailed on both sides; a bench that sends only
equal short prompts cannot show what a long prompt does to the rows
already decoding. Each mix draws, per request, a prompt length (in the
text units the load producer builds texts of) and a max_new_tokens:

- `mixed`: every prompt `--tokens`, max_new_tokens uniform over MIXED_NEW_TOKENS;
- `equal`: every prompt `--tokens`, max_new_tokens `--equal-tokens`;
- `lognormal`: prompts and outputs lognormal (LOGNORMAL_PROMPT, LOGNORMAL_OUTPUT), clipped;
- `short`: `mixed` served by the consumer configured for long prompts (the baseline of `long`);
- `long`: `short` with LONG_SHARE of the prompts LONG_PROMPT tokens long, arriving among running rows.

Prompt lengths of the last three are given in the model's tokens and turned
into text units with TEXT_TOKENS_PER_TOKEN, measured with SmolLM2's
tokenizer on the producer's words.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.tools.bench.pipeline.options import MIXED_NEW_TOKENS

TEXT_TOKENS_PER_TOKEN = 1.44
"""Text units (`request_text`) per SmolLM2 token: 480 units made 335-337 tokens, 700 made 481-491."""
LONG_PROMPT = 512
"""`long`: tokens of a long prompt."""
LONG_SHARE = 0.1
"""`long`: share of requests with a long prompt."""
LOGNORMAL_PROMPT = (80.0, 0.9, 20, 512)
"""`lognormal` prompts: median tokens, sigma of the log, clipped to [low, high]."""
LOGNORMAL_OUTPUT = (40.0, 0.8, 10, MIXED_NEW_TOKENS[1])
"""`lognormal` max_new_tokens: median, sigma of the log, clipped to [low, high] (the bench model's
max_new_tokens is the high end: generating 500 tokens a request is minutes on 2 CPU cores)."""
LONG_INPUT_TOKENS = 640
"""max_input_tokens of the consumer in the mixes that carry long prompts (a 512-token prompt
drawn from the producer's words comes out a few tokens either side)."""
MIXES = ("mixed", "equal", "lognormal", "short", "long")


@dataclass(frozen=True)
class Lengths:
    """Per-request prompt sizes (text units) and max_new_tokens of one mix."""

    prompts: np.ndarray
    new_tokens: np.ndarray

    @property
    def mean_new_tokens(self) -> float:
        return float(self.new_tokens.mean()) if self.new_tokens.size else 0.0

    @property
    def mean_prompt_tokens(self) -> float:
        return float(self.prompts.mean()) / TEXT_TOKENS_PER_TOKEN if self.prompts.size else 0.0


def long_prompts(mix: str) -> bool:
    """Whether the mix's consumer is configured for prompts up to LONG_INPUT_TOKENS."""
    return mix in ("lognormal", "short", "long")


def _lognormal(rng: np.random.Generator, count: int, spec: tuple[float, float, int, int]) -> np.ndarray:
    median, sigma, low, high = spec
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, size=count)), low, high).astype(np.int64)


def draw(mix: str, count: int, seed: int, *, tokens: int, equal_tokens: int) -> Lengths:
    """The prompt sizes and max_new_tokens of `count` requests of `mix` (seeded)."""
    if mix not in MIXES:
        raise ValueError(f"unknown length mix {mix!r} (known: {', '.join(MIXES)})")
    rng = np.random.default_rng(seed + 11)
    low, high = MIXED_NEW_TOKENS
    if mix == "equal":
        return Lengths(np.full(count, tokens, dtype=np.int64), np.full(count, equal_tokens, dtype=np.int64))
    if mix == "lognormal":
        prompts = np.round(_lognormal(rng, count, LOGNORMAL_PROMPT) * TEXT_TOKENS_PER_TOKEN).astype(np.int64)
        return Lengths(prompts, _lognormal(rng, count, LOGNORMAL_OUTPUT))
    new = rng.integers(low, high + 1, size=count)
    prompts = np.full(count, tokens, dtype=np.int64)
    if mix == "long":
        prompts[rng.random(count) < LONG_SHARE] = round(LONG_PROMPT * TEXT_TOKENS_PER_TOKEN)
    return Lengths(prompts, new)
