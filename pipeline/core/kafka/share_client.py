"""Share groups (KIP-932) through confluent-kafka's preview `ShareConsumer`: the one module that uses it.

aiokafka has no share groups, so share-mode consumers read their requests
with confluent-kafka's `ShareConsumer` (2.16), a preview in the Python
client. What it is, and what this module does about it:

- synchronous and not thread-safe: each `ShareMember` owns one client and
  one thread of its own, and every call on that client goes through that
  thread, so the asyncio loop never blocks and never races it;
- explicit acknowledgement: every record of a poll must be acknowledged
  (ACCEPT, RELEASE or REJECT) before the next poll; `acknowledge` only
  records the verdict, the broker hears it with the next poll or commit,
  so `settle` acknowledges and commits in one step;
- no RENEW of a record's lock (KIP-1222 is not in this client): a record
  not acknowledged within the group's `share.record.lock.duration.ms` goes
  back to the group, and the consumer checks its profile against that lock
  at start (`consumers/sharing.py`);
- `max.poll.records` is a soft bound: the broker hands out whole record
  batches (KAFKA-17863, apache/kafka#17592), so a producer that batches
  many requests into one record batch gives one poll all of them. Kafka 4.2
  can hold a fetch to the limit (KIP-1206, `share.acquire.mode=record_limit`,
  apache/kafka#20246), but librdkafka 2.16 has no such property ("No such
  configuration property", checked here). So `ShareMember.poll` keeps the
  first `max_records` of a poll and RELEASEs the rest at once: they go back
  to the group for any member (each such record counts one more delivery
  against the group's delivery limit);
- `share.auto.offset.reset` is a group config, not a client property: its
  default, latest, skips every record produced before the group first
  fetched, so `prepare_share_group` sets it to earliest through the admin
  API before any member joins.

Records come out as aiokafka `ConsumerRecord`s so that admission and the
rest of the consumer read them as they read a partition group's.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from aiokafka import ConsumerRecord
from confluent_kafka import AcknowledgeType, KafkaError, KafkaException, ShareConsumer
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType

from pipeline.core.config import ConfigError, KafkaSettings
from pipeline.core.kafka.client import REDACTOR

log = logging.getLogger("batchtide.kafka")

Verdict = Literal["accept", "release", "reject"]
"""How a share record is acknowledged: answered, given back to the group, or never to be processed."""
_ACK_TYPES = {"accept": AcknowledgeType.ACCEPT, "release": AcknowledgeType.RELEASE, "reject": AcknowledgeType.REJECT}

LOCK_MS_CONFIG = "share.record.lock.duration.ms"
DELIVERY_LIMIT_CONFIG = "share.delivery.count.limit"
RESET_CONFIG = "share.auto.offset.reset"
DEFAULT_LOCK_MS = 30_000
"""The broker default of `group.share.record.lock.duration.ms`, assumed when the group's cannot be read."""
DEFAULT_DELIVERY_LIMIT = 5
"""The broker default of `group.share.delivery.count.limit`."""
ADMIN_TIMEOUT_S = 15.0
RECORD_BYTES_GUESS = 512
"""Bytes per request record assumed when a poll's size is bounded in bytes as well as in records."""


class ShareGroupsUnavailable(ConfigError):
    """The broker cannot run share groups (older than 4.2, or `share.version` not enabled)."""


@dataclass(frozen=True)
class ShareGroupConfig:
    """What the broker applies to one share group."""

    lock_ms: int
    """How long a delivered record stays acquired by its member without an acknowledgement."""
    delivery_limit: int
    """Deliveries after which a record is archived instead of delivered again."""


def librdkafka_options(settings: KafkaSettings) -> dict[str, Any]:
    """Connection and security properties for confluent-kafka's clients, from the same settings as aiokafka's."""
    options: dict[str, Any] = {
        "bootstrap.servers": settings.bootstrap_servers,
        "security.protocol": settings.security_protocol.lower(),
    }
    if settings.security_protocol in ("SSL", "SASL_SSL"):
        for key, value in (
            ("ssl.ca.location", settings.ssl_cafile),
            ("ssl.certificate.location", settings.ssl_certfile),
            ("ssl.key.location", settings.ssl_keyfile),
        ):
            if value:
                options[key] = value
    if settings.security_protocol in ("SASL_PLAINTEXT", "SASL_SSL"):
        password = settings.sasl_password
        if not settings.sasl_username or password is None:
            raise ConfigError(
                f"kafka.security_protocol={settings.security_protocol} needs kafka.sasl_username (or env "
                "BATCHTIDE_KAFKA_USERNAME) and env BATCHTIDE_KAFKA_PASSWORD"
            )
        REDACTOR.add(password)
        options |= {
            "sasl.mechanism": settings.sasl_mechanism,
            "sasl.username": settings.sasl_username,
            "sasl.password": password,
        }
    return options


def _unsupported(group_id: str, error: object) -> ShareGroupsUnavailable:
    return ShareGroupsUnavailable(
        f'[consumer] group_type = "share" needs a broker that runs share groups (Apache Kafka 4.2 or newer, '
        f"feature share.version=1); the broker at hand refused share group {group_id!r}: {error}"
    )


def _admin_call(futures: dict[Any, Any]) -> list[Any]:
    return [future.result(timeout=ADMIN_TIMEOUT_S) for future in futures.values()]


def _prepare(settings: KafkaSettings, group_id: str) -> ShareGroupConfig:
    admin = AdminClient({**librdkafka_options(settings), "log_level": 3})
    resource = ConfigResource(ResourceType.GROUP, group_id)
    reset = ConfigResource(
        ResourceType.GROUP,
        group_id,
        incremental_configs=[ConfigEntry(RESET_CONFIG, "earliest", incremental_operation=AlterConfigOpType.SET)],
    )
    try:
        _admin_call(admin.incremental_alter_configs([reset]))
        (described,) = _admin_call(admin.describe_configs([resource]))
    except KafkaException as e:
        raise _unsupported(group_id, e.args[0] if e.args else e) from None
    if RESET_CONFIG not in described:
        raise _unsupported(group_id, f"its group configs have no {RESET_CONFIG}")

    def number(name: str, default: int) -> int:
        entry = described.get(name)
        try:
            return int(entry.value) if entry is not None and entry.value is not None else default
        except ValueError:
            return default

    return ShareGroupConfig(
        number(LOCK_MS_CONFIG, DEFAULT_LOCK_MS), number(DELIVERY_LIMIT_CONFIG, DEFAULT_DELIVERY_LIMIT)
    )


async def prepare_share_group(settings: KafkaSettings, group_id: str) -> ShareGroupConfig:
    """Make `group_id` start at the earliest record, and read its lock and delivery limit.

    Raises `ShareGroupsUnavailable` with a plain message on a broker without share groups.
    """
    return await asyncio.to_thread(_prepare, settings, group_id)


async def set_group_config(settings: KafkaSettings, group_id: str, **configs: str | int) -> None:
    """Set share-group configs (dots written as underscores: share_record_lock_duration_ms=15000)."""

    def alter() -> None:
        admin = AdminClient({**librdkafka_options(settings), "log_level": 3})
        entries = [
            ConfigEntry(key.replace("_", "."), str(value), incremental_operation=AlterConfigOpType.SET)
            for key, value in configs.items()
        ]
        _admin_call(
            admin.incremental_alter_configs([ConfigResource(ResourceType.GROUP, group_id, incremental_configs=entries)])
        )

    await asyncio.to_thread(alter)


@dataclass(frozen=True, slots=True)
class ShareRecord:
    """A delivered record and how many times the group has delivered it (1 on the first delivery)."""

    record: ConsumerRecord[bytes, bytes]
    delivery_count: int


def _record(message: Any) -> ConsumerRecord[bytes, bytes]:
    key, value = message.key(), message.value()
    _, timestamp = message.timestamp()
    return ConsumerRecord(
        topic=message.topic(),
        partition=message.partition(),
        offset=message.offset(),
        timestamp=timestamp,
        timestamp_type=0,
        key=key,
        value=value,
        checksum=None,
        serialized_key_size=len(key) if key is not None else -1,
        serialized_value_size=len(value) if value is not None else -1,
        headers=tuple((name, raw or b"") for name, raw in (message.headers() or ())),
    )


class ShareMember:
    """One member of a share group: a `ShareConsumer` and the one thread that may touch it.

    A poll's records are held until `settle` gives each of them a verdict
    (the client refuses the next poll before that); `close` releases
    whatever is still held, then leaves the group.
    """

    def __init__(
        self, settings: KafkaSettings, group_id: str, client_id: str, topics: list[str], max_records: int
    ) -> None:
        self.client_id = client_id
        self.topics = topics
        self._max_records = max(1, max_records)
        self._options = {
            **librdkafka_options(settings),
            "group.id": group_id,
            "client.id": client_id,
            "share.acknowledgement.mode": "explicit",
            "max.poll.records": max(1, max_records),
            "max.partition.fetch.bytes": max(1, max_records) * RECORD_BYTES_GUESS,
            "fetch.wait.max.ms": 100,
            "socket.timeout.ms": settings.request_timeout_ms,
            "log_level": 4,
        }
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"share-{client_id}")
        self._client: Any = None
        self.held: set[tuple[str, int, int]] = set()
        """(topic, partition, offset) of every record of the last poll not yet settled."""
        self.closed = False
        self.released_excess = 0
        """Records handed out past `max_records` and released at once (the client's bound is soft)."""

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def open(self) -> None:
        def start() -> None:
            client = ShareConsumer(self._options)
            client.subscribe(self.topics)
            self._client = client

        await self._call(start)

    async def poll(self, timeout_s: float, limit: int | None = None) -> list[ShareRecord]:
        """The next records for this member (none within `timeout_s`: an empty list), at most `limit`
        of them (default: `max_records`; the rest are released at once)."""
        if self.held:
            raise RuntimeError(f"share member {self.client_id}: {len(self.held)} records of its last poll unsettled")
        if self.closed:
            return []

        def poll() -> list[ShareRecord]:
            out = []
            for message in self._client.poll(timeout_s):
                error = message.error()
                if error is not None:
                    if error.code() != KafkaError._PARTITION_EOF:
                        log.warning("share member %s: poll error %s", self.client_id, error)
                    continue
                out.append(ShareRecord(_record(message), message.delivery_count() or 1))
            return out

        records: list[ShareRecord] = await self._call(poll)
        bound = self._max_records if limit is None else max(1, min(limit, self._max_records))
        kept, excess = records[:bound], records[bound:]
        if excess:
            await self._release_now(excess)
        self.held = {(r.record.topic, r.record.partition, r.record.offset) for r in kept}
        return kept

    async def _release_now(self, excess: list[ShareRecord]) -> None:
        """Give back what a poll handed out past `max_records` (the client's bound is soft)."""
        places = [(r.record.topic, r.record.partition, r.record.offset) for r in excess]

        def release() -> None:
            for place in places:
                self._client.acknowledge_offset(*place, AcknowledgeType.RELEASE)
            self._client.commit_async()

        try:
            await self._call(release)
        except KafkaException as e:
            log.warning(
                "share member %s: releasing %d records past its poll bound failed: %s", self.client_id, len(places), e
            )
        self.released_excess += len(places)

    async def settle(self, verdicts: dict[tuple[str, int, int], Verdict]) -> int:
        """Acknowledge the held records (all of them: those missing from `verdicts` are released) and
        commit the acknowledgements; returns how many the broker refused."""
        if self.closed or not self.held:
            self.held.clear()
            return 0
        held, self.held = self.held, set()

        def settle() -> int:
            for place in held:
                self._client.acknowledge_offset(*place, _ACK_TYPES[verdicts.get(place, "release")])
            results = self._client.commit_sync(ADMIN_TIMEOUT_S)
            return sum(1 for error in (results or {}).values() if error is not None)

        try:
            refused: int = await self._call(settle)
        except KafkaException as e:
            log.warning("share member %s: acknowledgement of %d records failed: %s", self.client_id, len(held), e)
            refused = len(held)
        return refused

    async def close(self) -> None:
        """Release what is held, leave the group, stop the thread."""
        if self.closed:
            return
        if self.held:
            await self.settle({})
        self.closed = True

        def close() -> None:
            if self._client is not None:
                self._client.close()

        try:
            await self._call(close)
        except KafkaException as e:
            log.warning("share member %s: close failed: %s", self.client_id, e)
        finally:
            self._thread.shutdown(wait=False)


MEMBER_SEPARATOR = "#"


def member_client_id(consumer_id: str, role: str) -> str:
    """The client id of one of a consumer's share members: `<consumer id>#<role>` (0, 1, ..., priority)."""
    return f"{consumer_id}{MEMBER_SEPARATOR}{role}"


def consumer_of(client_id: str) -> str:
    """The consumer a share member belongs to (a partition group's member id is the consumer's)."""
    return client_id.rsplit(MEMBER_SEPARATOR, 1)[0]
