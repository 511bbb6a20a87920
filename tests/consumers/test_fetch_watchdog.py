"""The fetch watchdog's decisions, driven with positions and times (no broker): a partition whose
position stands still while it has records to read gets a metadata refresh, then a reconnect."""

from __future__ import annotations

from aiokafka import TopicPartition

from consumers.fetch_watchdog import StallTracker

A = TopicPartition("requests", 0)
B = TopicPartition("requests", 1)


def test_a_partition_that_moves_is_never_a_suspect() -> None:
    tracker = StallTracker(stall_s=6.0)
    for step in range(20):
        assert tracker.observe({A: step * 10, B: step}, now_s=step * 1.5) == []


def test_a_standing_partition_gets_a_refresh_then_a_reconnect_then_a_fresh_period() -> None:
    tracker = StallTracker(stall_s=6.0)
    tracker.observe({A: 5, B: 0}, now_s=0.0)
    assert tracker.observe({A: 5, B: 1}, now_s=5.9) == []
    suspects = tracker.observe({A: 5, B: 2}, now_s=6.0)
    assert suspects == [A]
    first = tracker.remedy(suspects, now_s=6.0)
    assert first.refresh == {A} and not first.reconnect
    assert not tracker.remedy(tracker.observe({A: 5, B: 3}, now_s=8.0), now_s=8.0).reconnect, (
        "too soon after the refresh"
    )
    second = tracker.remedy(tracker.observe({A: 5, B: 4}, now_s=9.0), now_s=9.0)
    assert second.reconnect == {A} and not second.refresh
    assert tracker.observe({A: 5, B: 5}, now_s=14.0) == [], "a reconnect starts a new stall period"
    assert tracker.observe({A: 5, B: 6}, now_s=15.0) == [A]


def test_progress_after_a_refresh_clears_the_stall() -> None:
    tracker = StallTracker(stall_s=6.0)
    tracker.observe({A: 5}, now_s=0.0)
    assert tracker.remedy(tracker.observe({A: 5}, now_s=6.0), now_s=6.0).refresh == {A}
    assert tracker.observe({A: 9}, now_s=7.0) == []
    assert tracker.observe({A: 9}, now_s=12.9) == []
    again = tracker.remedy(tracker.observe({A: 9}, now_s=13.0), now_s=13.0)
    assert again.refresh == {A} and not again.reconnect, "a new stall starts with a refresh again"


def test_a_caught_up_partition_waits_a_whole_period_again() -> None:
    tracker = StallTracker(stall_s=6.0)
    tracker.observe({A: 5}, now_s=0.0)
    assert tracker.observe({A: 5}, now_s=6.0) == [A]
    tracker.idle([A], now_s=6.0)
    assert tracker.observe({A: 5}, now_s=11.0) == []
    assert tracker.observe({A: 5}, now_s=12.0) == [A]


def test_a_partition_no_longer_fetched_is_forgotten() -> None:
    tracker = StallTracker(stall_s=6.0)
    tracker.observe({A: 5, B: 1}, now_s=0.0)
    tracker.observe({B: 2}, now_s=3.0)
    assert tracker.observe({A: 5, B: 3}, now_s=7.0) == [], "A came back (resumed or reassigned): a new period"
