"""Forwards: a request handed to a faster peer through a priority partition that peer owns.

Which requests go, and to whom, is `pipeline.engine.fleet.plan_forwards`
(from the peers' beacons, `consumers.fleet`); this module is the record a
forward travels as. The forward carries the original record time
in a header (waiting keeps counting from the first enqueue), and the header
doubles as the loop guard: a request that arrived as a forward is never
forwarded again. Exactly-once answering rests on three rules: the
original's offset is acknowledged only after the forward is on the broker,
the forwarding consumer withdraws it from its own engine, and every
consumer remembers the ids it answered (`consumers.intake.RecentIds`) to
drop stray duplicates.
"""

from __future__ import annotations

from consumers.answers import Held
from consumers.intake import ORIG_TS_HEADER

FORWARDED_BY_HEADER = "batchtide-forwarded-by"
"""Which consumer forwarded the request (for tracing; not trusted for logic)."""


def forward_headers(held: Held, consumer_id: str) -> list[tuple[str, bytes]]:
    return [
        (ORIG_TS_HEADER, str(held.enqueue_ms).encode()),
        (FORWARDED_BY_HEADER, consumer_id.encode()),
    ]
