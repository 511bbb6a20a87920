"""TxnOffsetCommit v3 (KIP-447): a transaction's offsets carry the consumer's generation and member id.

aiokafka 0.14 sends `send_offsets_to_transaction` as TxnOffsetCommit v0,
which names no group member, so the group coordinator accepts the offsets
of a member it has already expelled: a "zombie" transaction commits its
answers and offsets while the partition's new owner answers the same
records (apache/kafka#7897, KIP-447). From v3 the request carries the
member's generation id, member id and group instance id, and the
coordinator refuses a stale one with ILLEGAL_GENERATION, UNKNOWN_MEMBER_ID
or FENCED_INSTANCE_ID. Flexible version: compact strings and arrays,
tagged fields, request header v2 (aiokafka's Struct types do the encoding).

`fence_txn_offsets` makes one producer send v3. It has to reach into
aiokafka's sender, which builds the request itself and offers no hook: it
replaces that producer's `_do_txn_offset_commit` (the step that sends the
offsets to the GROUP coordinator after AddOffsetsToTxn) with one that uses
`FencedTxnOffsetCommitHandler`, a subclass of aiokafka's handler that
builds v3 and reads its answer. Every other error keeps aiokafka's handling.

A refused commit fails the offsets' future with `TxnOffsetsRefused`, so
`send_offsets_to_transaction` raises it, and leaves the transaction open:
the caller must abort it (`async with producer.transaction()` does). Not
aiokafka's `error_transaction`: it forgets the partitions already in the
transaction, after which an abort sends no EndTxn and the broker keeps the
transaction, answers included, open until the next one commits it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from aiokafka.client import CoordinationType
from aiokafka.errors import GroupAuthorizationFailedError, KafkaError
from aiokafka.producer.sender import TxnOffsetCommitHandler
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import CompactArray, CompactString, Int16, Int32, Int64, Schema, TaggedFields

API_KEY = 28
VERSION = 3
ILLEGAL_GENERATION = 22
UNKNOWN_MEMBER_ID = 25
FENCED_INSTANCE_ID = 82
FENCING_ERRORS = frozenset({ILLEGAL_GENERATION, UNKNOWN_MEMBER_ID, FENCED_INSTANCE_ID})
"""Partition errors by which the coordinator refuses offsets from a member that is not (or no longer) current."""
NO_GENERATION = -1
NO_MEMBER = ""


@dataclass(frozen=True, slots=True)
class GroupMember:
    """Who commits: the consumer's generation and member id (and static instance id, if any)."""

    generation_id: int
    member_id: str
    group_instance_id: str | None = None


class TxnOffsetsRefused(KafkaError):
    """The group coordinator refused a transaction's offsets: the member is not current."""

    def __init__(self, group_id: str, member: GroupMember, error_code: int) -> None:
        super().__init__(
            f"group {group_id} refused the offsets of generation {member.generation_id} member "
            f"{member.member_id or '(none)'} with error {error_code}"
        )
        self.error_code = error_code


class TxnOffsetCommitResponse_v3(Response):
    API_KEY = API_KEY
    API_VERSION = VERSION
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "topics",
            CompactArray(
                ("name", CompactString("utf-8")),
                ("partitions", CompactArray(("partition_index", Int32), ("error_code", Int16), ("tags", TaggedFields))),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class TxnOffsetCommitRequest_v3(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = API_KEY
    API_VERSION = VERSION
    RESPONSE_TYPE = TxnOffsetCommitResponse_v3
    SCHEMA = Schema(
        ("transactional_id", CompactString("utf-8")),
        ("group_id", CompactString("utf-8")),
        ("producer_id", Int64),
        ("producer_epoch", Int16),
        ("generation_id", Int32),
        ("member_id", CompactString("utf-8")),
        ("group_instance_id", CompactString("utf-8")),
        (
            "topics",
            CompactArray(
                ("name", CompactString("utf-8")),
                (
                    "partitions",
                    CompactArray(
                        ("partition_index", Int32),
                        ("committed_offset", Int64),
                        ("committed_leader_epoch", Int32),
                        ("committed_metadata", CompactString("utf-8")),
                        ("tags", TaggedFields),
                    ),
                ),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class FencedTxnOffsetCommit(Request[TxnOffsetCommitRequest_v3]):
    """Only v3: a broker without it (Kafka < 2.5) refuses the request as an unsupported version."""

    API_KEY = API_KEY

    def __init__(
        self,
        transactional_id: str,
        group_id: str,
        producer_id: int,
        producer_epoch: int,
        member: GroupMember,
        offsets: dict[Any, tuple[int, str]],
    ) -> None:
        by_topic: dict[str, list[tuple[int, int, int, str, dict[int, bytes]]]] = defaultdict(list)
        for tp, (offset, metadata) in sorted(offsets.items()):
            by_topic[tp.topic].append((tp.partition, offset, -1, metadata, {}))
        self._args: tuple[object, ...] = (
            transactional_id,
            group_id,
            producer_id,
            producer_epoch,
            member.generation_id,
            member.member_id,
            member.group_instance_id,
            [(topic, partitions, {}) for topic, partitions in by_topic.items()],
            {},
        )

    def build(self, request_struct_class: type[TxnOffsetCommitRequest_v3]) -> TxnOffsetCommitRequest_v3:
        return request_struct_class(*self._args)


def partition_errors(response: Any) -> dict[tuple[str, int], int]:
    """Each (topic, partition)'s error code in a TxnOffsetCommit v3 response."""
    return {(topic, partition): error for topic, partitions, _ in response.topics for partition, error, _ in partitions}


class FencedTxnOffsetCommitHandler(TxnOffsetCommitHandler):
    """aiokafka's handler, sending v3 as `member` and refusing the whole commit on a fencing error."""

    def __init__(self, sender: Any, offsets: Any, group_id: str, member: GroupMember) -> None:
        super().__init__(sender, offsets, group_id)
        self._member = member

    def create_request(self) -> FencedTxnOffsetCommit:
        txn = self._sender._txn_manager
        offsets = {tp: (o.offset, o.metadata) for tp, o in self._offsets.items()}
        return FencedTxnOffsetCommit(
            txn.transactional_id, self._group_id, txn.producer_id, txn.producer_epoch, self._member, offsets
        )

    def handle_response(self, resp: Any) -> float | None:
        errors = partition_errors(resp)
        fencing = sorted({e for e in errors.values() if e in FENCING_ERRORS})
        if fencing:
            refuse(self._sender._txn_manager, TxnOffsetsRefused(self._group_id, self._member, fencing[0]))
            return None
        by_topic: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for (topic, partition), error in errors.items():
            by_topic[topic].append((partition, error))
        result: float | None = super().handle_response(SimpleNamespace(errors=list(by_topic.items())))
        return result


def refuse(txn_manager: Any, error: TxnOffsetsRefused) -> None:
    """Fail the offsets being committed with `error`, keeping the transaction's partitions (see the module note)."""
    _, _, done = txn_manager._pending_txn_offsets.popleft()
    if not done.done():
        done.set_exception(error)


def fence_txn_offsets(producer: Any, member: Callable[[], GroupMember]) -> None:
    """Make a started transactional `producer` commit offsets as TxnOffsetCommit v3, as `member()` at that moment.

    Not a member (no generation or member id, which v3 would accept like v0): refused without asking."""
    sender = producer._sender

    async def do_txn_offset_commit(offsets: Any, group_id: str) -> None:
        if not offsets:
            return
        try:
            node_id = await sender._find_coordinator(CoordinationType.GROUP, group_id)
        except GroupAuthorizationFailedError as exc:
            sender._txn_manager.error_transaction(exc)
            return
        now = member()
        if now.generation_id == NO_GENERATION or now.member_id == NO_MEMBER:
            refuse(sender._txn_manager, TxnOffsetsRefused(group_id, now, UNKNOWN_MEMBER_ID))
            return
        await FencedTxnOffsetCommitHandler(sender, offsets, group_id, now).do(node_id)

    sender._do_txn_offset_commit = do_txn_offset_commit
