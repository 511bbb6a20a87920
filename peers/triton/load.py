"""Open-loop Poisson load generator for the PyTriton MiniLM server.

It replays exactly the load `batchtide bench pipeline` sends for the same --rates, --duration,
--seed and --tokens: the same Poisson schedule and the same text per request, after the same
warm-up (150 requests at 50 req/s, not counted). Every request is fired as its own asyncio task at
its scheduled time, so a slow answer never delays the next send.
Latency = response arrival - moment just before send.

Usage:
  python load.py --rates 20,60,120 --duration 30 --seed 1 --tokens 10 [--json OUT] [--protocol http|grpc]
"""

import argparse
import asyncio
import json
import os
import re
import sys
import time

import numpy as np

# batchtide's load generator (pipeline/tools/devtools/producer.py), replayed exactly: the same word list,
# the same schedule and the same text for every request of a given seed.
WORDS = (
    "river stone light batch queue window token cloud signal model request answer "
    "tail latency kafka partition engine summer market garden orbit paper music"
).split()
CHARS_PER_TOKEN = 4
MODEL = "minilm"
WARMUP = 150


def batchtide_load(rate, duration, seed, tokens):
    """(send times in s, texts) as `poisson_load(rate, duration, seed, tokens=tokens)` and
    `LoadProducer(seed=seed).payloads()` make them."""
    rng = np.random.default_rng(seed)
    count = rng.poisson(rate * duration)
    send_s = np.sort(rng.uniform(0.0, duration * 1000.0, size=count)) / 1000.0
    words = np.random.default_rng(seed)
    size = max(1, (tokens * CHARS_PER_TOKEN) // 6)
    texts = [" ".join(WORDS[i] for i in words.choice(len(WORDS), size=size)) for _ in range(count)]
    return send_s, texts


class Client:
    def __init__(self, protocol, url):
        self.protocol = protocol
        if protocol == "http":
            import tritonclient.http.aio as tc

            # big connection pool so requests never wait client-side for a free connection
            self.c = tc.InferenceServerClient(url=url, conn_limit=4096, conn_timeout=120.0)
        else:
            import tritonclient.grpc.aio as tc

            self.c = tc.InferenceServerClient(url=url)
        self.tc = tc

    def make_inputs(self, text):
        inp = self.tc.InferInput("text", [1, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[text.encode()]], dtype=np.object_))
        return [inp]

    def make_outputs(self):
        if self.protocol == "http":
            return [self.tc.InferRequestedOutput("embedding", binary_data=True)]
        return [self.tc.InferRequestedOutput("embedding")]

    async def infer(self, inputs, outputs):
        res = await self.c.infer(MODEL, inputs, outputs=outputs)
        return res.as_numpy("embedding")

    async def close(self):
        await self.c.close()


async def fetch_metrics(url):
    """Return {metric_name: value} for the minilm model from Triton's Prometheus endpoint (or {})."""
    import aiohttp

    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
                txt = await r.text()
    except Exception:
        return {}
    out = {}
    labels = re.escape(f'{{model="{MODEL}",version="1"}}')
    for m in re.finditer(rf"^(nv_inference_\w+){labels} (\S+)$", txt, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


async def fire(client, sched, texts, drain_timeout):
    """Send one request per scheduled time (seconds from now). Returns (lat_s, ok, send_lag_s, t_sent, t_done)."""
    n = len(sched)
    lat = np.full(n, np.nan)
    lag = np.full(n, np.nan)
    t_done = np.full(n, np.nan)
    errors = []
    payloads = [client.make_inputs(text) for text in texts]
    outputs = client.make_outputs()
    t0 = time.perf_counter()

    async def one(i):
        start = time.perf_counter()
        lag[i] = start - (t0 + sched[i])
        try:
            emb = await client.infer(payloads[i], outputs)
            end = time.perf_counter()
            if emb is None or emb.shape[-1] != 384:
                raise RuntimeError(f"bad output shape {None if emb is None else emb.shape}")
            lat[i] = end - start
            t_done[i] = end - t0
        except Exception as e:
            errors.append(repr(e)[:200])

    tasks = []
    for i in range(n):
        delay = t0 + sched[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    t_last_send = time.perf_counter() - t0
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=drain_timeout)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    return lat, lag, t_done, t_last_send, errors


def pct(a, q):
    return float(np.percentile(a, q)) if len(a) else float("nan")


async def run_rate(client, rate, args):
    # warm-up as batchtide's bench: 150 requests at 50 req/s, drained, not counted
    w, w_texts = batchtide_load(50.0, WARMUP / 50.0, args.seed, args.tokens)
    await fire(client, w, w_texts, args.drain_timeout)

    m0 = await fetch_metrics(args.metrics_url)
    sched, texts = batchtide_load(rate, args.duration, args.seed, args.tokens)
    lat, lag, t_done, t_last_send, errors = await fire(client, sched, texts, args.drain_timeout)
    m1 = await fetch_metrics(args.metrics_url)

    sent = len(sched)
    ok = ~np.isnan(lat)
    answered = int(ok.sum())
    lat_ms = lat[ok] * 1000.0
    res = {
        "rate": rate,
        "sent": sent,
        "answered": answered,
        "errors": len(errors),
        "achieved_send_rate": sent / t_last_send if t_last_send > 0 else float("nan"),
        "answered_throughput": answered / float(np.nanmax(t_done)) if answered else 0.0,
        "p50_ms": pct(lat_ms, 50),
        "p90_ms": pct(lat_ms, 90),
        "p99_ms": pct(lat_ms, 99),
        "p999_ms": pct(lat_ms, 99.9),
        "max_ms": float(lat_ms.max()) if answered else float("nan"),
        "mean_ms": float(lat_ms.mean()) if answered else float("nan"),
        "send_lag_p99_ms": pct(lag[~np.isnan(lag)] * 1000.0, 99),
        "send_lag_max_ms": float(np.nanmax(lag) * 1000.0) if sent else float("nan"),
    }
    if m0 and m1:
        d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
        execs = d.get("nv_inference_exec_count", 0.0)
        reqs = d.get("nv_inference_request_success", 0.0)
        if execs > 0:
            res["triton_batches"] = int(execs)
            res["triton_requests"] = int(reqs)
            res["mean_batch_size"] = d.get("nv_inference_count", 0.0) / execs
            res["mean_queue_ms"] = d.get("nv_inference_queue_duration_us", 0.0) / max(reqs, 1) / 1000.0
            res["mean_compute_ms"] = d.get("nv_inference_compute_infer_duration_us", 0.0) / max(reqs, 1) / 1000.0
    if errors:
        res["first_errors"] = errors[:3]
    return res


def fmt(r):
    s = (
        f"rate {r['rate']:g}/s: answered/sent {r['answered']}/{r['sent']}  "
        f"achieved {r['achieved_send_rate']:.1f}/s sent, {r['answered_throughput']:.1f}/s answered  "
        f"p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  p999 {r['p999_ms']:.2f} ms  "
        f"(max {r['max_ms']:.2f}, send-lag p99 {r['send_lag_p99_ms']:.2f} ms)"
    )
    if "mean_batch_size" in r:
        s += (
            f"\n    triton: {r['triton_batches']} batches, mean batch size {r['mean_batch_size']:.2f}, "
            f"mean queue {r['mean_queue_ms']:.2f} ms, mean compute (batch exec time seen per request) {r['mean_compute_ms']:.2f} ms"
        )
    if r["errors"]:
        s += f"\n    errors: {r['errors']} e.g. {r.get('first_errors')}"
    return s


async def main_async(args):
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    client = Client(args.protocol, args.url)
    results = {}
    try:
        for rate in rates:
            r = await run_rate(client, rate, args)
            print(fmt(r), flush=True)
            key = f"{rate:g}"
            results[key] = r
            await asyncio.sleep(args.pause)
    finally:
        await client.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="20,60,120", help="comma separated requests/s")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of measured load per rate")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=10, help="approximate tokens per text (batchtide's --tokens)")
    ap.add_argument("--json", default=None, help="write {rate: {p50_ms, p99_ms, p999_ms, answered, sent, ...}}")
    ap.add_argument("--protocol", choices=["http", "grpc"], default="http")
    ap.add_argument("--url", default=None, help="host:port (default localhost:8000 http / localhost:8001 grpc)")
    ap.add_argument("--metrics-url", default=f"http://127.0.0.1:{os.environ.get('METRICS_PORT', '8002')}/metrics")
    ap.add_argument(
        "--drain-timeout", type=float, default=60.0, help="seconds to wait for outstanding answers after the last send"
    )
    ap.add_argument("--pause", type=float, default=2.0, help="idle seconds between rates")
    args = ap.parse_args()
    if args.url is None:
        args.url = (
            f"127.0.0.1:{os.environ.get('HTTP_PORT', '8000')}"
            if args.protocol == "http"
            else f"127.0.0.1:{os.environ.get('GRPC_PORT', '8001')}"
        )
    asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
