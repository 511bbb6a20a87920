"""Tail forwarding: hand overdue requests this consumer cannot serve soon to the whole group.

A consumer whose partitions run hot builds a local queue deeper than one
batch. Its overdue requests (past the tail threshold) beyond the next batch
would wait at least one more compute time here, while another consumer of
the group may be idle. Forwarding them to the model's priority topic lets
any consumer pull them first. The forward carries the original record time
in a header (waiting keeps counting from the first enqueue), and the header
doubles as the loop guard: a request that arrived as a forward is never
forwarded again. Exactly-once answering rests on three rules: the
original's offset is acknowledged only after the forward is on the broker,
the forwarding consumer withdraws it from its own engine, and every
consumer remembers the ids it answered (`consumers.intake.RecentIds`) to
drop stray duplicates.
"""

from __future__ import annotations

from collections.abc import Iterable

from consumers.answers import Held
from consumers.intake import ORIG_TS_HEADER
from pipeline.engine.decisions import PendingRequest

FORWARDED_BY_HEADER = "batchtide-forwarded-by"
"""Which consumer forwarded the request (for tracing; not trusted for logic)."""


def forward_headers(held: Held, consumer_id: str) -> list[tuple[str, bytes]]:
    return [
        (ORIG_TS_HEADER, str(held.enqueue_ms).encode()),
        (FORWARDED_BY_HEADER, consumer_id.encode()),
    ]


def tails_to_forward(waiting: Iterable[PendingRequest], next_batch: int, overdue_before_ms: float) -> list[PendingRequest]:
    """Overdue requests (recorded before `overdue_before_ms`: see
    `BatchingEngine.overdue_before_ms`) that will not fit in the next local batch, oldest first.

    The oldest `next_batch` of them are left for the next batch; the rest would
    wait for a later one. Requests that already came as forwards stay (no ping-pong).
    """
    overdue = [
        pr
        for pr in waiting
        if pr.enqueue_ms < overdue_before_ms and not pr.payload.forwarded_in
    ]
    if len(overdue) <= next_batch:
        return []
    overdue.sort(key=lambda pr: pr.enqueue_ms)
    return overdue[next_batch:]
