"""`Replay.recommended`: which candidate `batchtide replay` recommends when the candidates trade
throughput against expiries.

The figures are those the generation replay predicted for a recorded trace run (`bench pipeline
--runner smollm --trace ... --record`): the profile that ran and the in-flight and wait candidates
served 0.58 req/s and expired 23%, the 10 s step budget expired none but served 0.41 req/s and its p99
was 3.7 times longer. No candidate was best on both, and the replay stopped on `min()` of nothing.
"""

from __future__ import annotations

import math

from pipeline.core.config import BatchProfile
from pipeline.tools.bench.replay import Prediction, Recorded, Replay
from pipeline.tools.bench.replay_generation import generation_candidates

RAN = BatchProfile(
    cost_unit="tokens",
    hard_cap=1054,
    target_size=342,
    max_inflight_batches=226,
    slo_p99_ms=11_031.8,
    slo_ms_per_new_token=323.5,
)
RECORDED = Recorded(
    requests=116,
    p50_ms=11_831.0,
    p99_ms=47_154.9,
    p999_ms=55_388.2,
    throughput_rps=0.590,
    marked_share=0.0,
    overhead_ms=22.0,
)


def _prediction(name: str, profile: BatchProfile, p99_ms: float, rate: float, expired: float) -> Prediction:
    nan = math.nan
    return Prediction(name, profile, nan, p99_ms, nan, rate, nan, expired, nan, nan)


def _trace_window() -> list[Prediction]:
    out = []
    for name, profile in generation_candidates(RAN):
        if name == "step budget 10 s":
            out.append(_prediction(name, profile, 152_966.6, 0.409, 0.0))
        else:
            out.append(_prediction(name, profile, 41_044.4, 0.576, 0.233))
    return out


def test_a_candidate_that_expires_fewer_by_serving_slower_is_not_recommended() -> None:
    predictions = _trace_window()
    assert {p.name for p in predictions} >= {"ran", "step budget 10 s"}
    best = Replay(None, None, RECORDED, predictions).recommended()
    # keeping the rate comes first: of the candidates that serve 0.58 req/s, the first with the lowest p99
    assert best.name == "ran"


def test_fewer_expiries_at_the_same_rate_win_over_a_lower_p99() -> None:
    predictions = _trace_window()
    predictions[1] = _prediction("expires less", RAN.replace(max_inflight_batches=113), 45_000.0, 0.576, 0.10)
    assert Replay(None, None, RECORDED, predictions).recommended().name == "expires less"


def test_a_candidate_without_figures_is_never_recommended_over_one_with_them() -> None:
    predictions = _trace_window()
    predictions[0] = _prediction("ran", RAN, math.nan, math.nan, math.nan)
    assert Replay(None, None, RECORDED, predictions).recommended().name != "ran"
