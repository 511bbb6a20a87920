"""What a running consumer counts: read by tests, the CLI's periodic status line and the benches."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ConsumerStats:
    """Counters a test or the CLI can read while the consumer runs."""

    fetched: int = 0
    answered: dict[str, int] = field(default_factory=lambda: {"ok": 0, "expired": 0, "error": 0, "rejected": 0})
    dead_letters: int = 0
    batches: int = 0
    forwarded: int = 0
    queue: int = 0
    """Requests held in the engine right now."""
    max_queue_seen: int = 0
    """Highest `queue` ever observed; never above ConsumerSettings.max_queue."""
    pauses: int = 0
    commits: int = 0
    backlog: int = 0
    """Kafka lag of the assigned partitions at the last fetch."""
    warm_up_sizes: list[int] = field(default_factory=list)
    """Batch sizes run before joining the group."""
    rebuilt: int = 0
    """Records rebuilt to fit their topic or moved off a reply topic that could not take them."""
    delivery_retries: int = 0
    """Produce attempts that had to wait and try again (the broker or one of our topics unavailable)."""
    fetch_stalls_unblocked: int = 0
    """Stalled fetches the watchdog broke by closing the leaders' connections (consumers/fetch_watchdog.py)."""
    transactions_self_fenced: int = 0
    """Transactions aborted, and commits skipped, because the group membership was not fresh
    (consumers/fencing.py)."""
    txn_offsets_refused: int = 0
    """Transactions aborted because the group coordinator refused their offsets: this member was not
    (or no longer) current in its generation (TxnOffsetCommit v3, pipeline/core/kafka/txn_offset_commit.py)."""
    answered_inherited: int = 0
    """Records past a commit point that a partition's previous owner had answered (its commit's
    metadata; consumers/stable_start.py)."""
    stale_offset_records_skipped: int = 0
    """Records read again from a commit point and skipped because a previous owner answered them."""
    unstable_offsets_waited: int = 0
    """Newly assigned partitions whose commit point waited for an open transaction (UNSTABLE_OFFSET_COMMIT)."""
    unstable_offsets_given_up: int = 0
    """Of those, partitions still unstable after the wait: started from the last stable commit."""
    answered_left_out_of_metadata: int = 0
    """Most answered offsets past a commit point that one commit's metadata left out (its size cap):
    a next owner would answer them again."""
    share_accepted: int = 0
    """Share mode: records acknowledged ACCEPT (their answer is on the broker)."""
    share_rejected: int = 0
    """Share mode: records acknowledged REJECT (refused at admission, their dead letter on the broker)."""
    share_released: int = 0
    """Share mode: records given back to the group unanswered (at a stop, or after an error)."""
    share_redelivered: int = 0
    """Share mode: records delivered here that the group had delivered before (to any member)."""
    share_late_acks: int = 0
    """Share mode: acknowledgements the broker refused (the record's lock had expired: it is delivered again)."""
    share_released_excess: int = 0
    """Share mode: records a poll handed out past its bound and released at once (the client's bound
    is soft); each counts one more delivery against the group's delivery limit."""
