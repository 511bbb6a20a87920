"""A trace replayed as a producer's load: its times, prompts of its exact token counts, its answers' lengths.

A trace gives each prompt's length in tokens, not its text. A replay must cost the device what
the trace's request cost, so each prompt is built to exactly that count, as the serving model's
tokenizer counts it (`count` is the consumer's own measure: its runner's tokens in). Words are
drawn from a seeded stream; the longest run of them within the count is found by bisection, and
the rest is made up with a filler that adds one token each time (tried from a short list, since
which strings are one token depends on the tokenizer). Every prompt is checked: a tokenizer that
cannot be met exactly is an error, never a near miss.

Each request asks for exactly its answer's tokens: `max_new_tokens` is the trace's count and
`ignore_eos` is set, so the model generates them all (an end-of-sequence token does not end the
answer early), and it carries its index in the trace to its latency event.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pipeline.core.sim.generation.trace import Trace
from pipeline.tools.devtools.producer import WORDS, Load

FILLERS = (" a", " the", " x", ".", ",", " 1", "!", " I")
"""Candidate one-token additions, tried in order."""


class PromptError(ValueError):
    """No text of the asked token count could be built with this tokenizer."""


def exact_prompt(tokens: int, count: Callable[[str], int], words: list[str]) -> str:
    """A text of `words` (then fillers) that `count` makes exactly `tokens` tokens."""
    if tokens < 1:
        raise PromptError(f"a prompt has at least one token (asked {tokens})")

    def text(w: int) -> str:
        return " ".join(words[:w])

    lo, hi = 0, min(tokens, len(words))  # every word is a token at least: more than `tokens` never fits
    if count(text(hi)) <= tokens:
        lo = hi
    else:
        while hi - lo > 1:  # count(text(lo)) <= tokens < count(text(hi))
            mid = (lo + hi) // 2
            if count(text(mid)) <= tokens:
                lo = mid
            else:
                hi = mid
    base = text(lo)
    have = count(base) if base else 0
    if have == tokens:
        return base
    for filler in FILLERS:
        first = filler if base else filler.lstrip() or filler
        candidate = base + first + filler * (tokens - have - 1)
        if count(candidate) == tokens:
            return candidate
    raise PromptError(f"no text of exactly {tokens} tokens found (words reach {have}; no filler adds one token)")


def exact_prompts(counts: list[int], count: Callable[[str], int], seed: int) -> list[str]:
    """One prompt per count, each of its own seeded words (prompts differ, as real ones do)."""
    rng = np.random.default_rng(seed)
    out = []
    for tokens in counts:
        drawn = rng.choice(len(WORDS), size=max(1, tokens))
        out.append(exact_prompt(tokens, count, [WORDS[i] for i in drawn]))
    return out


def trace_load(trace: Trace, texts: list[str]) -> Load:
    """The trace's requests (a slice, already scaled) as a load: sent at their offsets from the slice's
    first request, each with its prompt text, its answer's length forced, and its index in the trace.
    A window opening before its first request would only put idle time ahead of the load, and a rate
    over the load's duration (tokens/s of a run) would count it."""
    n = len(trace)
    if len(texts) != n:
        raise ValueError(f"{len(texts)} prompts for {n} requests")
    offsets = trace.offset_ms.astype(float)
    return Load(
        offsets - (offsets[0] if n else 0.0),
        trace.prompt.copy(),
        np.ones(n, dtype=np.int64),
        new_tokens=trace.answer.copy(),
        texts=texts,
        trace_index=trace.index.copy(),
        ignore_eos=True,
    )
