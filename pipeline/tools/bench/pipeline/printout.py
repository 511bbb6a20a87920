"""The lines `bench pipeline` prints: a trial in a few lines, and the LLM modes' table."""

from __future__ import annotations

from typing import Any

from pipeline.tools.bench.pipeline.event_figures import STAGES
from pipeline.tools.bench.pipeline.trial import Trial


def describe(trial: Trial) -> str:
    return (
        f"  -> answered {trial.answered}/{trial.sent}, {trial.throughput_rps:.0f} req/s"
        + (f", {trial.tokens_per_s:.0f} tokens/s" if trial.tokens_per_s else "")
        + f"; e2e p50 {trial.p50_ms:.1f} ms, p99 {trial.p99_ms:.1f} ms, p999 {trial.p999_ms:.1f} ms"
        + f"; sender p99 lateness {trial.send_late_p99_ms:.1f} ms"
        + ("" if trial.sustained else "  [NOT sustained]")
        + (
            f"\n     TTFT p50 {trial.ttft_p50_ms:.0f} ms, p99 {trial.ttft_p99_ms:.0f} ms; time per output token "
            f"p50 {trial.tpot_p50_ms:.1f} ms, p99 {trial.tpot_p99_ms:.1f} ms"
            if trial.ttft_p99_ms == trial.ttft_p99_ms
            else ""
        )
        + (
            f"\n     outcomes {trial.outcomes}; consumer RSS start {trial.rss_start_mib:.0f} MiB, "
            f"peak {trial.rss_peak_mib:.0f} MiB, end {trial.rss_end_mib:.0f} MiB"
        )
        + stage_line(trial)
        + consumer_line(trial)
    )


def consumer_line(trial: Trial) -> str:
    if len(trial.by_consumer) < 2 and not trial.forwarded:
        return ""
    each = "; ".join(
        f"{name or '?'}: {f['share']:.0%} of answers, p50 {f['p50_ms']:.0f} ms, p99 {f['p99_ms']:.0f} ms"
        for name, f in trial.by_consumer.items()
    )
    return f"\n     by consumer: {each}; forwarded {trial.forwarded}"


def stage_line(trial: Trial) -> str:
    if not trial.stages_p50_ms:
        return ""
    stages = ", ".join(f"{name} {trial.stages_p50_ms[name]:.0f}/{trial.stages_p99_ms[name]:.0f}" for name in STAGES)
    return (
        f"\n     mean batch {trial.mean_batch:.1f}; consumer CPU {trial.consumer_cpu_ms_per_request:.2f} ms/request;"
        f" stage p50/p99 ms: {stages}"
    )


def label(run: dict[str, Any]) -> str:
    """The mode, with the step token budget when the run set one (`iteration/64`), and whether
    chunks rode in decode steps when the run said (`iteration/128/fused`, `.../separate`)."""
    budget, fused = run.get("step_token_budget"), run.get("chunk_fusion")
    name = run["mode"] if budget is None else f"{run['mode']}/{budget}"
    return name if fused is None else f"{name}/{'fused' if fused else 'separate'}"


def llm_table(out: dict[str, Any]) -> str:
    lines = [
        f"{'lengths':<9} {'mode':<24} {'req/s':>6} {'answered':>9} {'gen tok/s':>9} {'share':>6} {'p50 ms':>8} {'p99 ms':>8}"
        f" {'TTFT p99':>9} {'long TTFT p99':>13} {'TPOT p99':>9} {'goodput':>8} {'RSS peak MiB':>12}"
    ]
    for run in out["llm_runs"]:
        lines.append(
            f"{run['mix']:<9} {label(run):<24} {run['offered_rps']:>6g} {run['answered']:>4}/{run['sent']:<4} "
            f"{run['steady_generated_tokens_per_s']:>9.1f} {run['share_of_limit']:>6.2f} {run['p50_ms']:>8.0f} {run['p99_ms']:>8.0f}"
            f" {run['ttft_p99_ms']:>9.0f} {run.get('long_ttft_p99_ms', float('nan')):>13.0f} {run['tpot_p99_ms']:>9.1f} {run.get('goodput_rps', float('nan')):>8.2f} {run['rss_peak_mib']:>12.0f}"
        )
    return "\n".join(lines)
