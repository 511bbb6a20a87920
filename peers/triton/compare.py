"""Print batchtide's end-to-end latency next to the Triton peer's: same requests, rounds run one after the other.

    python peers/triton/compare.py TRITON_1.json BATCHTIDE_1.json [TRITON_2.json BATCHTIDE_2.json ...]

Each pair is one round: what `peers/triton/run.sh --json` wrote, then what
`batchtide bench pipeline --runner minilm --json` wrote right after. With
several rounds the summary compares medians, and counts the rounds each side
won: on a shared two-core host one round can be off by tens of percent.
Ratios below 1 mean batchtide is faster.
"""

from __future__ import annotations

import json
import statistics
import sys


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def rows(triton: dict, ours: dict) -> dict[str, dict[str, float]]:
    """Per offered rate present in both: the two sides' p50/p99/p999 and answered counts."""
    out = {}
    for rate in ours["model_p99_ms"]:
        if rate not in triton:
            continue
        trial = next(x for x in ours["model_trials"] if f"{x['offered_rps']:g}" == rate)
        t = triton[rate]
        out[rate] = {
            "t50": t["p50_ms"],
            "t99": t["p99_ms"],
            "t999": t["p999_ms"],
            "b50": ours["model_p50_ms"][rate],
            "b99": ours["model_p99_ms"][rate],
            "b999": ours["model_p999_ms"][rate],
            "lost": (t["sent"] - t["answered"]) + (trial["sent"] - trial["answered"]),
        }
    return out


def main(paths: list[str]) -> int:
    rounds = [rows(load(t), load(b)) for t, b in zip(paths[::2], paths[1::2], strict=True)]
    rates = [r for r in rounds[0] if all(r in each for each in rounds)]
    if not rates:
        print("no offered rate appears in every file", file=sys.stderr)
        return 2
    print(f"{'round':>5} {'req/s':>6} | {'Triton p50/p99/p999 ms':>24} | {'batchtide p50/p99/p999 ms':>26} | p99 ratio")
    for number, each in enumerate(rounds, 1):
        for rate in rates:
            r = each[rate]
            print(
                f"{number:>5} {rate:>6} | {r['t50']:6.1f} / {r['t99']:6.1f} / {r['t999']:6.1f} | "
                f"{r['b50']:7.1f} / {r['b99']:6.1f} / {r['b999']:6.1f} | {r['b99'] / r['t99']:9.2f}"
            )
    print(f"\nover {len(rounds)} round(s), medians:")
    print(
        f"{'req/s':>6} | {'Triton p50 / p99':>17} | {'batchtide p50 / p99':>20} | p50 ratio | p99 ratio | p99 won | unanswered"
    )
    for rate in rates:
        med = {k: statistics.median(each[rate][k] for each in rounds) for k in ("t50", "t99", "b50", "b99")}
        won = sum(each[rate]["b99"] < each[rate]["t99"] for each in rounds)
        lost = sum(each[rate]["lost"] for each in rounds)
        print(
            f"{rate:>6} | {med['t50']:7.1f} / {med['t99']:6.1f} | {med['b50']:9.1f} / {med['b99']:7.1f} | "
            f"{med['b50'] / med['t50']:9.2f} | {med['b99'] / med['t99']:9.2f} | {won:>3} of {len(rounds)} | {lost}"
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 3 or len(sys.argv) % 2 == 0:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1:]))
