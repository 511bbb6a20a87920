"""A decode loop's pace from its timed steps (pipeline.core.engine.decode_pace), on virtual step times."""

from __future__ import annotations

import pytest

from pipeline.core.engine.decode_pace import LEARN_STEPS, PACE_STEPS, StepPace


def step(rows: float) -> float:
    """A decode step of SmolLM2 on one core, roughly: 50 ms, +5 ms a row."""
    return 50.0 + 5.0 * rows


def learned(rows_seen: range = range(1, 9), rounds: int = 4) -> StepPace:
    pace = StepPace()
    for _ in range(rounds):
        for rows in rows_seen:
            pace.stepped(rows, step(rows))
    return pace


def test_steady_steps_give_the_curve_by_rows_at_pace_one() -> None:
    pace = learned()
    assert pace.learned and pace.pace == pytest.approx(1.0)
    for rows in (1, 4, 8):
        assert pace.step_ms(rows) == pytest.approx(step(rows))
    assert [rows for rows, _ in pace.points()] == list(range(1, 9))
    assert [ms for _, ms in pace.points()] == pytest.approx([step(rows) for rows in range(1, 9)])
    assert not StepPace().learned and StepPace().step_ms(3) is None
    fresh = StepPace()
    for _ in range(LEARN_STEPS - 1):
        fresh.stepped(2, step(2))
    assert not fresh.learned


@pytest.mark.parametrize("factor", [0.5, 2.0, 2.9])
def test_a_device_that_changes_speed_shows_within_a_few_steps_at_every_row_count(factor: float) -> None:
    """Steps at 2 rows only, then at 2.9x (a co-tenant on the core): the curve at 8 rows, not run
    since, follows too; and it comes back as soon as the steps do."""
    pace = learned()
    for _ in range(PACE_STEPS // 2):
        pace.stepped(2, factor * step(2))
    assert pace.step_ms(8) == pytest.approx(step(8), rel=0.01), "not yet: a few steps"
    pace.stepped(2, factor * step(2))
    assert pace.step_ms(8) == pytest.approx(factor * step(8), rel=0.01)
    for _ in range(40):  # long after: the shape is still the device's, the pace carries the change
        pace.stepped(3, factor * step(3))
    assert pace.step_ms(8) == pytest.approx(factor * step(8), rel=0.01)
    assert pace.step_ms(1) == pytest.approx(factor * step(1), rel=0.01)
    for _ in range(PACE_STEPS // 2 + 1):
        pace.stepped(5, step(5))
    assert pace.step_ms(8) == pytest.approx(step(8), rel=0.01), "back at its speed"


def test_a_stray_slow_step_moves_nothing() -> None:
    pace = learned()
    pace.stepped(4, 10 * step(4))
    pace.stepped(4, step(4))
    pace.stepped(4, 6 * step(4))
    assert pace.pace == pytest.approx(1.0)
    assert pace.step_ms(4) == pytest.approx(step(4))


def test_rows_never_measured_read_off_the_neighbours_and_the_curve_never_falls() -> None:
    pace = StepPace()
    for _ in range(8):
        pace.stepped(2, step(2))
        pace.stepped(6, step(6))
        pace.stepped(4, step(2) - 5.0)  # noise put 4 rows under 2
    ms = [ms for _, ms in pace.points()]
    assert ms == sorted(ms)
    assert step(2) - 5.0 <= (pace.step_ms(3) or 0.0) <= step(6)
    pace.stepped(0, 5.0)
    pace.stepped(3, 0.0)
    assert pace.steps == 24, "a step of no rows or no time is no measure"
