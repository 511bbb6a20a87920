"""The first answer per request id: how a results reader drops the answers a share group repeats.

Share mode is at-least-once: a consumer that stops between publishing an
answer and acknowledging its record (a crash, a kill, a lock that expired
while its batch ran) leaves the record to be delivered again, and it is
answered again. Both answers are on the results topic; a reader keeps the
first per request id and drops the rest. batchtide's own readers
(`batchtide results`, the benches' and chaos runs' ledgers) read through
`FirstAnswers`; any other reader of a share-mode model's results does the
same by the request id every answer carries.

How long an id is kept: a repeat comes from a delivery that began after the
first answer's record was delivered, at most once per lock period, and the
group stops delivering a record after `share.delivery.count.limit` tries.
So the last possible repeat arrives within delivery limit x (lock +
longest batch) of the first answer: 5 x 30 s = 150 s with the broker's
defaults. Ids are kept for `window_ms` of result time (the record
timestamps, not the reader's clock, so a reader that starts late or reads
a backlog keeps the same ids), `DEFAULT_WINDOW_MS` unless the reader knows
its group's lock and limit (`window_for`), and in memory only: a reader
that restarts starts from an empty window, so it reads from a point at
least one window before the answers it cares about.
"""

from __future__ import annotations

from collections import deque

DEFAULT_WINDOW_MS = 300_000
"""Twice the longest repeat gap with the broker's defaults (5 deliveries x 30 s locks)."""


def window_for(lock_ms: int, delivery_limit: int, longest_batch_ms: float = 0.0) -> int:
    """Twice the latest a repeat can follow the first answer: `delivery_limit` locks, each with a batch."""
    return int(2 * delivery_limit * (lock_ms + longest_batch_ms))


class FirstAnswers:
    """Remembers request ids answered within the last `window_ms` of result time."""

    def __init__(self, window_ms: int = DEFAULT_WINDOW_MS) -> None:
        self.window_ms = window_ms
        self._seen: set[str] = set()
        self._order: deque[tuple[int, str]] = deque()
        self._newest_ms = 0
        self.repeats = 0
        """Answers dropped because their id was answered before, within the window."""

    def first(self, request_id: str, timestamp_ms: int) -> bool:
        """True for the first answer of `request_id` in the window (keep it), False for a repeat (drop it)."""
        if timestamp_ms > self._newest_ms:
            self._newest_ms = timestamp_ms
            self._forget(timestamp_ms - self.window_ms)
        if request_id in self._seen:
            self.repeats += 1
            return False
        self._seen.add(request_id)
        self._order.append((timestamp_ms, request_id))
        return True

    def _forget(self, before_ms: int) -> None:
        order, seen = self._order, self._seen
        while order and order[0][0] < before_ms:
            seen.discard(order.popleft()[1])

    def __len__(self) -> int:
        return len(self._seen)
