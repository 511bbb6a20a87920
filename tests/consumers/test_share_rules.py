"""Share mode's rules that need no broker: the record lock against the profile, and the first answer per id."""

from __future__ import annotations

import pytest

from consumers.sharing import LOCK_SHARE, check_lock, enforce_lock, layout_warning, predicted_batch_ms
from pipeline.core.config import BatchProfile, ConfigError, ModelConfig, parse_config
from pipeline.core.kafka.first_answers import FirstAnswers, window_for


def test_the_predicted_batch_follows_the_measured_curve_and_extends_past_it() -> None:
    points = [(1, 10.0), (8, 24.0), (32, 72.0)]
    assert predicted_batch_ms(points, 8) == 24.0
    assert predicted_batch_ms(points, 20) == pytest.approx(48.0)
    assert predicted_batch_ms(points, 64) == pytest.approx(72.0 + 2.0 * 32)


def test_a_batch_that_outlives_half_the_lock_refuses_to_start() -> None:
    model = ModelConfig(name="m", runner="cost-model", cost_a_ms=9000.0, cost_c_ms=100.0)
    check = check_lock(model, 64, (), lock_ms=30_000)
    assert check.longest_batch_ms == pytest.approx(9000.0 + 100.0 * 64)
    assert not check.fits
    with pytest.raises(ConfigError, match=r"record lock \(30000 ms\)"):
        enforce_lock(model, check)


def test_a_deadline_bounds_how_long_a_record_is_held() -> None:
    model = ModelConfig(
        name="m", runner="cost-model", cost_a_ms=9000.0, cost_c_ms=100.0, profile=BatchProfile(default_deadline_ms=5000)
    )
    check = check_lock(model, 64, (), lock_ms=30_000)
    assert check.longest_batch_ms == 5000.0 and check.fits


def test_a_profile_curve_is_read_before_the_runner_and_a_model_without_one_is_only_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    measured = check_lock(ModelConfig(name="m"), 32, [(1, 100.0), (32, 20_000.0)], lock_ms=30_000)
    assert measured.longest_batch_ms == 20_000.0 and not measured.fits
    unknown = check_lock(ModelConfig(name="m"), 32, (), lock_ms=30_000)
    assert unknown.longest_batch_ms is None and unknown.fits
    enforce_lock(ModelConfig(name="m"), unknown)
    assert "cannot check its batches against the record lock" in caplog.text
    assert LOCK_SHARE * 30_000 == 15_000


def test_share_mode_refuses_transactions_when_the_config_loads() -> None:
    with pytest.raises(ConfigError, match="share acknowledgements cannot join a Kafka transaction"):
        parse_config({"kafka": {"transactional": True}, "consumer": {"group_type": "share"}})
    with pytest.raises(ConfigError, match=r"group_type: 'queue' is not one of \['consumer', 'share'\]"):
        parse_config({"consumer": {"group_type": "queue"}})


def test_a_repeat_within_the_window_is_dropped_and_an_old_id_is_forgotten() -> None:
    first = FirstAnswers(window_ms=1000)
    assert first.first("a", 100)
    assert not first.first("a", 900)
    assert first.first("b", 1500)
    assert first.first("a", 1500 + 1)  # "a" was answered at 100, more than a window before 1501
    assert first.repeats == 1
    assert len(first) == 2


def test_the_window_covers_every_delivery_a_group_makes() -> None:
    assert window_for(30_000, 5) == 300_000
    assert window_for(15_000, 2, longest_batch_ms=5_000) == 80_000


def test_share_mode_warns_about_a_layout_that_keeps_a_slow_member_on_partitions_of_its_own() -> None:
    assert layout_warning(ModelConfig(name="m"), 1) is None
    warning = layout_warning(ModelConfig(name="m", profile=BatchProfile(max_inflight_batches=2)), 4)
    assert warning is not None and "4 partitions" in warning and "runs 3 on the request topic" in warning
