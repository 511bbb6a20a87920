"""Which `__transaction_state` partition (hence which coordinator) a transactional id has, as Kafka
computes it. Expected values were printed by Kafka's own `Utils.abs(id.hashCode()) % n`, the body of
`TransactionStateManager.partitionFor` in 3.9.1 and still in 4.4.0; both releases print the same."""

from __future__ import annotations

import pytest

from pipeline.core.kafka.cluster import java_string_hash, transaction_partition

KAFKA = [
    # (transactional id, String.hashCode, partition of 4, partition of 50)
    ("bt.consumers.chaos.c1-0", -1129852052, 0, 2),
    ("bt.consumers.chaos.c1-1", -1129852051, 3, 1),
    ("bt.consumers.chaos.c1-3", -1129852049, 1, 49),
    ("bt.consumers.chaos.c2-7", -1129851084, 0, 34),
    ("héllo-wörld-ü", -1830219685, 1, 35),
    ("polygenelubricants", -2147483648, 0, 0),
]


@pytest.mark.parametrize(("transactional_id", "hash_code", "of_4", "of_50"), KAFKA)
def test_the_partition_is_kafkas(transactional_id: str, hash_code: int, of_4: int, of_50: int) -> None:
    assert java_string_hash(transactional_id) == hash_code
    assert transaction_partition(transactional_id, 4) == of_4
    assert transaction_partition(transactional_id, 50) == of_50


def test_a_negative_odd_hash_is_not_masked() -> None:
    """The producer partitioner's mask (h & 0x7fffffff) would put this id on partition 1, not 3."""
    assert (java_string_hash("bt.consumers.chaos.c1-1") & 0x7FFFFFFF) % 4 == 1
    assert transaction_partition("bt.consumers.chaos.c1-1", 4) == 3
