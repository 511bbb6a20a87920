"""Config loading and validation: clear messages that name the file, table and values."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.config import BatchProfile, ConfigError, load_config, parse_config


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "batchtide.toml"
    path.write_text(text)
    return path


def test_loads_a_valid_file_with_defaults_and_per_model_overrides(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
[defaults]
target_size = 16
hard_cap = 24
max_wait_ms = 10

[models.minilm]
runner = "transformers"
hard_cap = 32
cost_unit = "tokens"
target_size = 20

[models.sim]
runner = "cost-model"
cost_points = [[1, 5.0], [8, 9], [32, 30.5]]

[kafka]
topic_prefix = "bt"

[clickhouse]
database = "lat"

[consumer]
max_queue = 100
""",
    )
    config = load_config(path)
    minilm = config.model("minilm").profile
    assert (minilm.target_size, minilm.hard_cap, minilm.max_wait_ms) == (20, 32, 10)
    assert minilm.cost_unit == "tokens"
    sim = config.model("sim")
    assert sim.runner == "cost-model"
    assert sim.cost_points == ((1, 5.0), (8, 9.0), (32, 30.5))
    assert (sim.profile.target_size, sim.profile.hard_cap) == (16, 24)
    assert config.defaults.tail_mark_ratio == 1.5
    assert config.kafka.topic_prefix == "bt"
    assert config.clickhouse.database == "lat"
    assert config.consumer.max_queue == 100


def test_builtin_defaults_take_the_cap_from_the_device_not_a_number() -> None:
    config = load_config(None)
    profile = config.defaults
    assert (profile.target_size, profile.hard_cap, profile.max_wait_ms) == ("auto", "auto", 20.0)
    assert (profile.tail_mark_ratio, profile.tail_mark_quantile) == (1.5, 0.99)
    assert config.models == {}


def test_auto_and_explicit_caps_load_from_toml(tmp_path: Path) -> None:
    path = _write(tmp_path, '[defaults]\nhard_cap = "auto"\n[models.a]\nhard_cap = 48\ntarget_size = 32\n')
    config = load_config(path)
    assert config.defaults.hard_cap == "auto"
    assert (config.model("a").profile.hard_cap, config.model("a").profile.target_size) == (48, 32)
    bad = _write(tmp_path, '[defaults]\nhard_cap = "max"\n')
    with pytest.raises(ConfigError, match="hard_cap: expected a whole number or \"auto\", got 'max'"):
        load_config(bad)


def test_cap_below_target_names_both_values_and_the_table(tmp_path: Path) -> None:
    path = _write(tmp_path, "[models.m]\ntarget_size = 40\nhard_cap = 30\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert str(path) in message and "[models.m]" in message
    assert "hard_cap (30)" in message and "target_size (40)" in message


def test_unknown_key_names_file_table_key_and_the_known_ones(tmp_path: Path) -> None:
    path = _write(tmp_path, "[defaults]\ntarget_sise = 3\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert str(path) in message and "[defaults]" in message and "'target_sise'" in message
    assert "target_size" in message


def test_unknown_table_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "[kafak]\nbootstrap_servers = 'x:1'\n")
    with pytest.raises(ConfigError, match=r"unknown table \[kafak\]"):
        load_config(path)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("target_size = '32'", "target_size: expected a whole number or \"auto\", got '32'"),
        ("target_size = 3.5", 'target_size: expected a whole number or "auto", got 3.5'),
        ("max_wait_ms = true", "max_wait_ms: expected a number, got True"),
        ("adaptive_window = 1", "adaptive_window: expected true or false, got 1"),
        ("cost_unit = 'bytes'", "cost_unit: 'bytes' is not one of ['requests', 'tokens']"),
    ],
)
def test_wrong_types_and_bad_literals(tmp_path: Path, line: str, expected: str) -> None:
    path = _write(tmp_path, f"[models.enc]\n{line}\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert message.startswith(f"{path} [models.enc].")
    assert expected in message


def test_bad_runner_literal_in_model_table(tmp_path: Path) -> None:
    path = _write(tmp_path, "[models.x]\nrunner = 'onnx'\n")
    with pytest.raises(ConfigError, match=r"\[models.x\].runner: 'onnx' is not one of"):
        load_config(path)


def test_malformed_cost_points(tmp_path: Path) -> None:
    path = _write(tmp_path, "[models.x]\nrunner = 'cost-model'\ncost_points = [1, 2]\n")
    with pytest.raises(ConfigError, match=r"\[models.x\].cost_points: expected \[\[batch, ms\]"):
        load_config(path)


def test_missing_file_and_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    broken = _write(tmp_path, "[defaults\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"tail_mark_ratio": 0.8}, "tail_mark_ratio (0.8) must be >= 1"),
        ({"tail_mark_ratio": 1.0, "tail_mark_quantile": 0.5}, "tail_mark_ratio (1.0) must be > 1"),
        ({"tail_mark_quantile": 1.0}, "tail_mark_quantile must be in (0, 1)"),
        ({"hard_cap": 0}, "hard_cap must be a whole number >= 1"),
        ({"min_wait_ms": 30.0}, "min_wait_ms (30.0) must be between 0 and max_wait_ms (20.0)"),
        ({"max_inflight_batches": 0}, "max_inflight_batches must be >= 1"),
        ({"knee_tolerance": 1.0}, "knee_tolerance must be in [0, 1)"),
        ({"tail_mark_floor_ms": -1.0}, "tail_mark_floor_ms must be >= 0"),
        ({"wait_sample_window": 8, "tail_min_samples": 16}, "wait_sample_window (8) must be >="),
        ({"slo_ms_per_new_token": -1.0}, "slo_ms_per_new_token must be >= 0"),
    ],
)
def test_profile_value_checks(changes: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as error:
        BatchProfile(**changes)
    assert fragment in str(error.value)


def test_value_errors_in_files_name_file_and_table() -> None:
    with pytest.raises(ConfigError) as error:
        parse_config({"models": {"gen": {"tail_mark_ratio": 0.5}}}, "prod.toml")
    assert str(error.value).startswith("prod.toml [models.gen]: tail_mark_ratio (0.5)")


def test_tail_marking_zero_turns_it_off() -> None:
    assert BatchProfile(tail_mark_ratio=0).tail_marking is False
    assert BatchProfile().tail_marking is True


def test_generation_slo_grows_with_max_new_tokens_and_so_does_the_derived_budget() -> None:
    """slo_p99_ms 1000 + 64 tokens x 50 ms = 4200 ms for a request asking for 64: the engine's budget is half."""
    model = parse_config(
        {"models": {"gen": {"task": "generate", "max_new_tokens": 64, "slo_ms_per_new_token": 50.0}}}
    ).model("gen")
    assert model.profile.budget_ms() == 500.0
    assert model.engine_profile().compute_budget_ms == 2100.0
    capped = parse_config(
        {"models": {"gen": {"max_new_tokens": 64, "slo_ms_per_new_token": 50.0, "default_deadline_ms": 3000.0}}}
    ).model("gen")
    assert capped.engine_profile().compute_budget_ms == 1500.0, "a shorter default deadline still bounds it"
    assert model.engine_profile().slo_p99_ms == 4200.0, "shedding judges by the longest request's SLO"
    explicit = parse_config({"models": {"gen": {"slo_ms_per_new_token": 50.0, "compute_budget_ms": 700.0}}}).model(
        "gen"
    )
    assert explicit.engine_profile().compute_budget_ms == 700.0
    plain = parse_config({"models": {"enc": {}}}).model("enc")
    assert plain.engine_profile() is plain.profile


def test_a_stop_budget_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"\[consumer\]: stop_timeout_s must be > 0 \(got 0\)"):
        parse_config({"consumer": {"stop_timeout_s": 0}})


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("replication_factor = 0", 'replication_factor: expected a whole number >= 1 or "auto", got 0'),
        ("replication_factor = 'three'", 'replication_factor: expected a whole number or "auto"'),
        ("min_insync_replicas = -1", 'min_insync_replicas: expected a whole number >= 1 or "auto", got -1'),
        ("replication_factor = 2\nmin_insync_replicas = 3", "min_insync_replicas (3) exceeds replication_factor (2)"),
        ("request_timeout_ms = 50", "request_timeout_ms: expected at least 1000, got 50"),
    ],
)
def test_bad_replication_settings_name_the_file_and_the_value(tmp_path: Path, line: str, expected: str) -> None:
    path = _write(tmp_path, f"[kafka]\n{line}\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value).startswith(str(path))
    assert expected in str(error.value)


def test_replication_is_automatic_by_default_and_settable(tmp_path: Path) -> None:
    from pipeline.core.kafka.client import replication

    defaults = load_config(None).kafka
    assert (defaults.replication_factor, defaults.min_insync_replicas) == ("auto", "auto")
    assert replication(defaults, brokers=1) == (1, 1)
    assert replication(defaults, brokers=2) == (2, 1)
    assert replication(defaults, brokers=3) == (3, 2)
    assert replication(defaults, brokers=5) == (3, 2)
    chosen = load_config(_write(tmp_path, "[kafka]\nreplication_factor = 5\nmin_insync_replicas = 3\n")).kafka
    assert replication(chosen, brokers=5) == (5, 3)
    with pytest.raises(ConfigError, match="replication_factor = 5 but the cluster has 3 live broker"):
        replication(chosen, brokers=3)
