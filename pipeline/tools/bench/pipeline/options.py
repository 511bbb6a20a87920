"""What `bench pipeline` is asked to run: the runner, the offered rates, the group, the LLM mode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

RunnerChoice = Literal["zero-cost", "minilm", "cost-model", "smollm"]
RUNNERS: tuple[RunnerChoice, ...] = ("zero-cost", "minilm", "cost-model", "smollm")
LlmMode = Literal["static", "iteration", "fixed"]
LLM_MODES: tuple[LlmMode, ...] = ("static", "iteration", "fixed")
Isolation = Literal["auto", "process", "thread"]
ISOLATIONS: tuple[Isolation, ...] = ("auto", "process", "thread")
MIXED_NEW_TOKENS = (8, 128)
"""max_new_tokens of the mixed LLM load: uniform over this range, inclusive."""
MODEL = "bench"
"""The model name every bench consumer serves (its topics are `<prefix>.requests.bench`, ...)."""


@dataclass(frozen=True)
class BenchOptions:
    runner: RunnerChoice = "zero-cost"
    rates: tuple[float, ...] = (20.0, 60.0, 120.0)
    duration_s: float = 30.0
    seed: int = 1
    torch_threads: int = 1
    bootstrap: str | None = None
    partitions: int = 4
    consumers: int = 1
    tokens: int = 24
    """Approximate tokens per request text."""
    hot_share: float = 0.0
    """Share of all requests sent to partition 0 (skewed load); 0 spreads by key."""
    tail_forwarding: bool = True
    cost_a_ms: float = 5.0
    cost_c_ms: float = 0.5
    max_queue: int = 4096
    adaptive_cap: bool = True
    """The engine's learned cap (product default); False holds the configured hard_cap."""
    hard_cap: int = 48
    isolation: Isolation = "auto"
    """Where the consumers run batches (the model config's `isolation`)."""
    late_consumer_s: float | None = None
    """Start the last consumer this long after the load began (to measure a rebalance)."""
    leaving_consumer_s: float | None = None
    """Stop the last consumer (a clean stop, as an autoscaler scales in) this long after the load began."""
    group_type: Literal["consumer", "share"] = "consumer"
    """The consumers' `[consumer] group_type`: a partition group, or a share group (docs/share-groups.md)."""
    find_max_duration_s: float = 8.0
    """Seconds per find-max trial (the ramp runs several)."""
    find_max_start: float = 2000.0
    find_max_limit: float = 40000.0
    llm_mode: LlmMode = "iteration"
    """smollm: static (engine batches in tokens, each run to its end), iteration (batches join
    the running decode set) or fixed (the field report's 20 ms window, cap 48 requests)."""
    new_tokens: int = 0
    """smollm: max_new_tokens of every request (the `equal` mix); 0: the `lengths` mix decides."""
    lengths: str = "mixed"
    """smollm: the prompt and output length mix (`lengths.MIXES`)."""
    step_token_budget: int | None = None
    """smollm, iteration: the consumer's step_token_budget (chunked prefill; 0 off); None: the default."""
    chunk_fusion: bool | None = None
    """smollm, iteration: the consumer's fused_chunks (chunks ride in decode steps); None: the default."""
    ttft_slo_ms: float = 5000.0
    """smollm: time-to-first-token objective of the goodput column."""
    tpot_slo_ms: float = 500.0
    """smollm: time-per-output-token objective of the goodput column."""
    llm_profile: str | None = None
    """smollm: the model's profile file (`batchtide profile`): its token cap and curve."""
    timeout_ms: int | None = None
    """Deadline of every measured request (Request.timeout_ms): past it the answer is `expired`,
    so an overloaded consumer sheds work instead of holding it (warm-up requests have none)."""
    straggler: float = 1.0
    """cost-model: consumer 0's t(b) multiplied by this (a slower device in the group)."""
    slowdown: tuple[float, float, float] | None = None
    """cost-model: (from_s, to_s, factor): consumer 0's t(b) multiplied by factor over that part of
    the measured load (a device that throttles mid-run)."""
    llm_model_keys: dict[str, Any] | None = None
    """smollm: the consumer's batching keys, instead of the mode's (a trace replay runs batchtide-default's layout)."""
    llm_warmup_s: float = 2.0
    """smollm: seconds of warm-up requests (4 a second, 8 new tokens each, not measured) before the load."""
    pin_cores: bool = False
    """Pin consumer i (and its device processes) to core i modulo the host's cores (`taskset`)."""
    co_tenant: tuple[float | None, float | None] | None = None
    """(from_s, to_s) of the load: a busy process shares consumer 0's pinned core over that span (None
    from: from the consumers' start; None to: to the trial's end), so that consumer's real model runs
    slower (`co_tenant.CoTenant`); None: no co-tenant."""
    record_dir: str | None = None
    """Keep each trial under this directory as `batchtide replay` reads it: the consumers' config, their
    profile and an embedded ClickHouse store the sink filled from the trial's events (`record`)."""
