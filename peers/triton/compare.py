"""Print batchtide's end-to-end latency next to the Triton peer's, same load, same run.

    python peers/triton/compare.py out/triton.json out/batchtide.json

The first file is what `peers/triton/run.sh --json` writes, the second what
`batchtide bench pipeline --runner minilm --json` writes. Ratios below 1 mean
batchtide is faster.
"""

from __future__ import annotations

import json
import sys


def main(triton_path: str, batchtide_path: str) -> int:
    with open(triton_path) as f:
        triton = json.load(f)
    with open(batchtide_path) as f:
        ours = json.load(f)
    rates = [rate for rate in ours["model_p99_ms"] if rate in triton]
    if not rates:
        print("no offered rate appears in both files", file=sys.stderr)
        return 2
    print(f"{'req/s':>6} | {'Triton p50/p99/p999 ms':>24} | {'batchtide p50/p99/p999 ms':>26} | p50 ratio | p99 ratio | answered")
    for rate in rates:
        t = triton[rate]
        b = {q: ours[f"model_{q}_ms"][rate] for q in ("p50", "p99", "p999")}
        trial = next(x for x in ours["model_trials"] if f"{x['offered_rps']:g}" == rate)
        print(
            f"{rate:>6} | {t['p50_ms']:6.1f} / {t['p99_ms']:6.1f} / {t['p999_ms']:6.1f} | "
            f"{b['p50']:7.1f} / {b['p99']:6.1f} / {b['p999']:6.1f} | "
            f"{b['p50'] / t['p50_ms']:9.2f} | {b['p99'] / t['p99_ms']:9.2f} | "
            f"Triton {t['answered']}/{t['sent']}, batchtide {trial['answered']}/{trial['sent']}"
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
