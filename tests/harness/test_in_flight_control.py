"""The calibration client's depth: as many requests in flight as the model answers within its objective."""

from __future__ import annotations

import pytest

from pipeline.tools.harness.saturation import HOLD_BELOW, TARGET, InFlightControl


def _serve(control: InFlightControl, per_s: float, answers: int) -> None:
    """A busy model answering `per_s` requests a second in order: an answer waits behind the requests in
    flight, so it takes depth / per_s (Little's law). Sent when the one before it came back."""
    now = 0.0
    for _ in range(answers):
        took = control.depth / per_s * 1000.0
        control.answered(now, now + took)
        now += 1000.0 / per_s


def test_the_depth_settles_where_the_answers_take_the_objective() -> None:
    control = InFlightControl(start=128, most=128, objective_ms=1000.0)
    _serve(control, per_s=80.0, answers=2000)
    depth, p90 = control.rounds[-1]
    assert HOLD_BELOW * 1000.0 <= p90 <= 1000.0
    assert depth == pytest.approx(TARGET * 80.0, abs=8), "about 72 in flight answer in 0.9 s at 80/s"


def test_a_slow_model_is_held_to_one_request_in_flight() -> None:
    control = InFlightControl(start=20, most=40, objective_ms=5000.0)
    _serve(control, per_s=0.1, answers=200)  # one answer takes 10 s alone
    assert control.depth == 1


def test_the_depth_grows_to_its_most_while_answers_come_back_fast() -> None:
    control = InFlightControl(start=1, most=40, objective_ms=5000.0)
    _serve(control, per_s=100.0, answers=500)
    assert control.depth == 40
    assert [d for d, _ in control.rounds][:4] == [1, 2, 4, 8], "at most doubling a round"


def test_answers_to_requests_sent_before_a_change_do_not_judge_the_new_depth() -> None:
    control = InFlightControl(start=10, most=40, objective_ms=1000.0)
    for k in range(5):
        control.answered(float(k), 3000.0 + k)  # slow: the depth halves, at 3004 ms
    assert control.depth == 5
    for k in range(10):
        control.answered(100.0 + k, 3100.0 + k)  # sent before the change: ignored
    assert control.depth == 5 and len(control.rounds) == 1
