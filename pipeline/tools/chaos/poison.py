"""Fault: requests that make the runner raise, inside batches of healthy ones."""

from __future__ import annotations

import time

from consumers.runners.cost_model import POISON_MARKER
from pipeline.tools.chaos.deployment import CostModelDevice, Deployment, Stage
from pipeline.tools.chaos.ledger import FaultReport, SeenAnswer
from pipeline.tools.chaos.steps import ChaosSizes, settle_answers


async def poison_request(stage: Stage, sizes: ChaosSizes) -> FaultReport:
    """Requests that make the runner raise, each inside a batch of healthy ones.

    The consumer must bisect the batch: the healthy requests get `ok`
    results, each culprit an `error` result and a dead letter with reason
    `runner_error` and the runner's error text.
    """
    device = CostModelDevice(a_ms=30.0, c_ms=1.0, target_size=8, hard_cap=16, max_wait_ms=40.0)
    poison_every = 50
    async with Deployment(stage, device, partitions=2, poison_marker=POISON_MARKER) as d:
        d.consumer("only")
        await d.warm_up(consumers=1)
        count = max(100, sizes.requests // 3)

        def text_for(i: int) -> str:
            return f"{POISON_MARKER} request {i}" if i % poison_every == poison_every // 2 else f"healthy request {i}"

        ids = await d.traffic.open_loop(count, sizes.rate_rps * 2, text_for=text_for)
        fault_end = time.time()
        await settle_answers(d, sizes, linger_s=1.0)
        d.check_alive()
        poison = [request_id for i, request_id in enumerate(ids) if POISON_MARKER in text_for(i)]
        healthy = sorted(set(ids) - set(poison))
        failures: list[str] = []
        for request_id in poison:
            letters = d.ledger.dead.get(request_id, [])
            if not any(x.reason == "runner_error" and "PoisonError" in x.detail for x in letters):
                failures.append(f"poison {request_id} has no runner_error dead letter naming the error")
            results = d.ledger.results.get(request_id, [])
            if not results or results[0].outcome != "error":
                failures.append(f"poison {request_id} did not get an `error` result")
        not_ok = [i for i in healthy if not d.ledger.results.get(i) or d.ledger.results[i][0].outcome != "ok"]
        if not_ok:
            failures.append(f"{len(not_ok)} healthy requests not answered ok (e.g. {not_ok[:3]})")
        batch_mates = _batch_mates(d, poison)
        if batch_mates == 0:
            failures.append("no poison request shared its batch with a healthy one: bisection untested")
        return d.ledger.report(
            "poison request (runner raises)",
            len(poison),
            fault_end=fault_end,
            failures=failures,
            details={
                "dead_lettered": sum(1 for p in poison if p in d.ledger.dead),
                "healthy_batch_mates_ok": batch_mates,
            },
        )


def _batch_mates(d: Deployment, poison: list[str]) -> int:
    """Healthy requests answered `ok` from the very batch that held a poison request."""
    batches: dict[tuple[str | None, int | None], list[SeenAnswer]] = {}
    for answers in d.ledger.results.values():
        first = answers[0]
        if first.batch_id is not None:
            batches.setdefault((first.consumer_id, first.batch_id), []).append(first)
    mates = 0
    for request_id in poison:
        seen = d.ledger.results.get(request_id)
        if not seen or seen[0].batch_id is None:
            continue
        key = (seen[0].consumer_id, seen[0].batch_id)
        mates += sum(1 for other in batches.get(key, []) if other.outcome == "ok")
    return mates
