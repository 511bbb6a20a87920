"""`bench pipeline --record DIR`: each trial kept where `batchtide replay` reads it.

A trial's directory (`DIR/<runner>-...-<rate>rps`) holds the config its consumers
ran with (`batchtide.toml`, whose [clickhouse] table names the store beside it),
the profile file they loaded (`profiles/bench.json`, when there was one) and an
embedded ClickHouse store (`clickhouse/`) with the trial's latency and batch
events. The events reach the store the way a user's do: `batchtide sink` reads
the trial's events topics. It runs once the consumers have stopped, so the
trial's figures are the same with or without recording: the sink's CPU never
shares the cores with the load, and the topics keep every event until it reads
them.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import Topics
from pipeline.sink.app import sink_group
from pipeline.tools.bench.pipeline.options import MODEL, BenchOptions
from pipeline.tools.harness.errors import HarnessError
from pipeline.tools.harness.group_offsets import committed_offsets, end_offsets
from pipeline.tools.harness.processes import Processes

CONFIG_FILE = "batchtide.toml"
STORE_DIR = "clickhouse"
PROFILE_FILE = Path("profiles") / f"{MODEL}.json"
"""Where the consumers' profile is copied (their BATCHTIDE_PROFILE_DIR), relative to the trial's directory."""
STORE_TIMEOUT_S = 180.0
"""Longest wait for the sink to store a trial's events (its start, chDB's schema, then the inserts)."""
REPLAY_SINCE = "30d"
"""The replay window printed: the store holds one trial only, so any window that reaches back to it
does; the raw rows' TTL (`[clickhouse] ttl_days`, 30 by default) drops them after that anyway."""


def trial_label(options: BenchOptions, rate: float) -> str:
    """What the trial ran, as a directory name: runner, batching mode, length mix, chunking, rate."""
    parts: list[str] = [options.runner]
    if options.runner == "smollm":
        parts += [options.llm_mode, options.lengths]
        if options.step_token_budget is not None:
            parts.append(f"budget{options.step_token_budget}")
        if options.chunk_fusion is not None:
            parts.append("fused" if options.chunk_fusion else "separate")
    parts.append(f"{rate:g}rps")
    return "-".join(parts)


def trial_dir(options: BenchOptions, rate: float) -> Path | None:
    """A new directory for this trial under `options.record_dir` (None when not recording); a
    label used before in the same directory gets -2, -3, ..."""
    if options.record_dir is None:
        return None
    root = Path(options.record_dir).resolve()
    label = trial_label(options, rate)
    path, n = root / label, 1
    while path.exists():
        n += 1
        path = root / f"{label}-{n}"
    path.mkdir(parents=True)
    return path


def clickhouse_table(directory: Path) -> dict[str, Any]:
    """The [clickhouse] table of a recorded trial's config: its own embedded store."""
    return {"data_dir": str(directory / STORE_DIR)}


def replay_command(directory: Path) -> str:
    """The command that replays a recorded trial and checks the prediction against it."""
    argv = ["batchtide", "replay", "--config", str(directory / CONFIG_FILE), "--model", MODEL]
    if (directory / PROFILE_FILE).is_file():
        argv += ["--profile", str(directory / PROFILE_FILE)]
    return shlex.join([*argv, "--since", REPLAY_SINCE, "--validate"])


async def store_events(
    kafka: KafkaSettings,
    directory: Path,
    processes: Processes,
    say: Callable[[str], None],
    timeout_s: float = STORE_TIMEOUT_S,
) -> None:
    """Run `batchtide sink` on the trial's config until it has stored (and so committed) every latency
    and batch event its consumers published, then stop it. The consumers must have stopped."""
    topics = Topics(kafka.topic_prefix)
    wanted: dict[tuple[str, int], int] = {}
    for topic in (topics.latency_events, topics.batch_events):
        wanted |= await end_offsets(kafka, topic)
    started = time.monotonic()
    sink = processes.sink(directory / CONFIG_FILE)
    try:
        while True:
            if not sink.alive:
                raise HarnessError(f"the recording sink exited with {sink.returncode}:\n{sink.log_tail()}")
            try:
                committed = await committed_offsets(kafka, sink_group(kafka.topic_prefix))
            except Exception:
                committed = {}
            if all(committed.get(tp, 0) >= end for tp, end in wanted.items()):
                break
            if time.monotonic() - started > timeout_s:
                raise HarnessError(
                    f"the recording sink stored not all events within {timeout_s:.0f} s:\n{sink.log_tail()}"
                )
            await asyncio.sleep(0.5)
    finally:
        await asyncio.to_thread(sink.terminate, 30.0)
    say(f"  recorded in {directory} (the sink stored the trial's events in {time.monotonic() - started:.0f} s)")


def replay_commands(figures: dict[str, Any]) -> list[str]:
    """The replay command of every recorded trial of a bench's figures, in the order they ran."""
    trials = [
        *figures.get("zero_cost_trials", []),
        *([figures["zero_cost_half_trial"]] if "zero_cost_half_trial" in figures else []),
        *figures.get("model_trials", []),
        *figures.get("llm_runs", []),
    ]
    return [t["replay_command"] for t in trials if t.get("replay_command")]
