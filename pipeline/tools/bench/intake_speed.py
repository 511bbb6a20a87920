"""How fast intake decodes: `python -m pipeline.tools.bench.intake_speed`.

Prints decode_request calls per second for small valid requests, for ~32-token
texts with a reply topic, for token-id requests, and for a hostile mix (one
third rejected), so a change to the hot path can be checked against the
consumer's target (>= 100k small decodes/s on one core).
"""

from __future__ import annotations

import argparse
import time

import msgspec

from consumers.intake import decode_request
from schemas.messages import Request

MODEL = "bench"


def _payloads() -> dict[str, list[bytes]]:
    enc = msgspec.json.encode
    small = [enc(Request(id=f"r{i}", model=MODEL, text="hello world")) for i in range(1000)]
    text32 = [
        enc(
            Request(
                id=f"req-{i:08d}", model=MODEL, text=" ".join(["token"] * 32), priority=i % 3, reply_topic="app.replies"
            )
        )
        for i in range(1000)
    ]
    ids = [enc(Request(id=f"t{i}", model=MODEL, token_ids=list(range(64)))) for i in range(1000)]
    hostile = []
    for i in range(1000):
        kind = i % 3
        if kind == 0:
            hostile.append(small[i])
        elif kind == 1:
            hostile.append(b'{"id":"x%d","model":"bench","text":"x","priority":12}' % i)
        else:
            hostile.append(small[i][:-3])
    return {
        "small (~50 B)": small,
        "text 32 words + reply": text32,
        "64 token ids": ids,
        "hostile mix (2/3 bad)": hostile,
    }


def rate(payloads: list[bytes], seconds: float) -> float:
    """Decodes per second over at least `seconds`."""
    done = 0
    start = time.perf_counter()
    while True:
        for value in payloads:
            decode_request(value, model=MODEL, max_bytes=1 << 20)
        done += len(payloads)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return done / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.tools.bench.intake_speed", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--seconds", type=float, default=1.0, help="time per payload kind (default 1)")
    args = parser.parse_args(argv)
    print(f"{'payload':<24} {'decodes/s':>12} {'us/decode':>10}")
    for name, payloads in _payloads().items():
        r = rate(payloads, args.seconds)
        print(f"{name:<24} {r:>12,.0f} {1e6 / r:>10.2f}")


if __name__ == "__main__":
    main()
