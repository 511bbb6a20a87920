"""The pending queue and its order: marked tails, then priority levels, then record time.

Every structure is a heap keyed by `(enqueue_ms, seq)`, so FIFO holds by the
Kafka record timestamp even when partitions deliver out of order. Removal is
lazy: a request that expired or was withdrawn stays in its heap as a
tombstoned sequence number until it surfaces at the top, where it is skipped.
No operation scans the whole queue.
"""

from __future__ import annotations

import heapq

from pipeline.core.engine.decisions import PendingRequest

Entry = tuple[float, int, PendingRequest]


class PendingQueue:
    """Requests waiting for a batch, in dispatch order, with O(log n) add and take."""

    def __init__(self, priority_levels: int, cost_in_tokens: bool) -> None:
        self._levels: list[list[Entry]] = [[] for _ in range(priority_levels)]
        self._marked: list[Entry] = []
        self._live: set[int] = set()
        """Sequence numbers of the requests still pending (the handles `remove` takes)."""
        self._removed: set[int] = set()
        """Tombstones: removed requests still sitting inside a heap."""
        self._seq = 0
        self._cost_in_tokens = cost_in_tokens
        self.count = 0
        """Requests pending."""
        self.cost = 0
        """Sum of pending requests' cost in the profile's unit."""
        self._level_cost = [0] * priority_levels
        self._marked_cost = 0

    def add(self, request: PendingRequest) -> int:
        """Queue a request; returns its sequence number (the handle for `remove`)."""
        seq = self._seq = self._seq + 1
        levels = self._levels
        level = request.priority
        if not 0 <= level < len(levels):
            level = 0 if level < 0 else len(levels) - 1
        heapq.heappush(levels[level], (request.enqueue_ms, seq, request))
        self._live.add(seq)
        cost = request.cost if self._cost_in_tokens else 1
        self.count += 1
        self.cost += cost
        self._level_cost[level] += cost
        return seq

    def _level_of(self, request: PendingRequest) -> int:
        return min(max(request.priority, 0), len(self._levels) - 1)

    def cost_ahead(self, priority: int) -> int:
        """Pending cost a new request of `priority` would wait behind: the marked tails and
        every level as urgent as its own (it joins the back of its level)."""
        level = min(max(priority, 0), len(self._levels) - 1)
        return self._marked_cost + sum(self._level_cost[: level + 1])

    def head(self) -> PendingRequest | None:
        """The request the next batch would start with."""
        for heap in (self._marked, *self._levels):
            entry = self._top(heap)
            if entry is not None:
                return entry[2]
        return None

    def remove(self, seq: int, request: PendingRequest) -> bool:
        """Drop a pending request wherever it sits (lazily); False if it already left."""
        if seq not in self._live:
            return False
        self._live.discard(seq)
        self._removed.add(seq)
        cost = request.cost if self._cost_in_tokens else 1
        self.count -= 1
        self.cost -= cost
        if request.marked:
            self._marked_cost -= cost
        else:
            self._level_cost[self._level_of(request)] -= cost
        return True

    def is_live(self, seq: int) -> bool:
        """Still pending."""
        return seq in self._live

    def _top(self, heap: list[Entry]) -> Entry | None:
        removed = self._removed
        while heap:
            entry = heap[0]
            if not removed or entry[1] not in removed:
                return entry
            heapq.heappop(heap)
            removed.discard(entry[1])
        return None

    def oldest_enqueue_ms(self) -> float | None:
        """Record time of the oldest pending request (the start of the batch's window)."""
        oldest: float | None = None
        for heap in (self._marked, *self._levels):
            entry = self._top(heap)
            if entry is not None and (oldest is None or entry[0] < oldest):
                oldest = entry[0]
        return oldest

    def mark_older_than(self, threshold_ms: float, now_ms: float, limit: int) -> int:
        """Mark (stickily) up to `limit` unmarked requests that waited past
        `threshold_ms`, oldest first across the levels.

        Only the heads of the levels are looked at: each is its level's oldest,
        so it crosses the threshold first; marking stops when no head has.
        `marked_at_ms` is when the wait crossed the threshold, which the engine
        only needs to notice before it next builds a batch.
        """
        marked = 0
        cutoff_ms = now_ms - threshold_ms
        while marked < limit:
            oldest: list[Entry] | None = None
            for heap in self._levels:
                entry = self._top(heap)
                if entry is not None and entry[0] < cutoff_ms and (oldest is None or entry < oldest[0]):
                    oldest = heap
            if oldest is None:
                break
            entry = heapq.heappop(oldest)
            request = entry[2]
            request.marked = True
            request.marked_at_ms = entry[0] + threshold_ms
            heapq.heappush(self._marked, entry)
            cost = request.cost if self._cost_in_tokens else 1
            self._level_cost[self._level_of(request)] -= cost
            self._marked_cost += cost
            marked += 1
        return marked

    def take(self, cap: int) -> list[PendingRequest]:
        """Pop requests in dispatch order while their summed cost fits `cap`.

        Packing stops at the first request that does not fit (order is kept);
        a single request costlier than the cap leaves alone rather than starve.
        """
        batch: list[PendingRequest] = []
        total = 0
        removed = self._removed
        live = self._live
        tokens = self._cost_in_tokens
        for heap in (self._marked, *self._levels):
            while heap:
                _, seq, request = heap[0]
                if removed and seq in removed:
                    heapq.heappop(heap)
                    removed.discard(seq)
                    continue
                cost = request.cost if tokens else 1
                if total + cost > cap and batch:
                    self._account(batch, total)
                    return batch
                heapq.heappop(heap)
                live.discard(seq)
                batch.append(request)
                total += cost
                if request.marked:
                    self._marked_cost -= cost
                else:
                    self._level_cost[self._level_of(request)] -= cost
                if total >= cap:
                    self._account(batch, total)
                    return batch
        self._account(batch, total)
        return batch

    def _account(self, batch: list[PendingRequest], total: int) -> None:
        self.count -= len(batch)
        self.cost -= total
