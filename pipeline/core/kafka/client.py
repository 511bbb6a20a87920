"""Kafka client settings (SASL/TLS) and the topic layout, shared by every client.

Every consumer, producer, admin client, the sink and the CLI build their
aiokafka keyword arguments with `client_options`, so a security setting added
to the config reaches all of them at once. The SASL password comes from the
environment only and is masked wherever the options are printed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaClient
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic
from aiokafka.cluster import ClusterMetadata
from aiokafka.errors import TopicAlreadyExistsError, for_code
from aiokafka.helpers import create_ssl_context
from aiokafka.protocol.metadata import MetadataRequest

from pipeline.core.config import ConfigError, KafkaSettings

log = logging.getLogger("batchtide.kafka")

CLIENT_STOP_S = 10.0
"""Longest wait for one client's stop() at shutdown (see `stop_client`)."""
REDACTED = "***"
SECRET_OPTIONS = frozenset({"sasl_plain_password"})


@dataclass(frozen=True)
class Topics:
    """Topic names of one deployment; every name starts with `<prefix>.`."""

    prefix: str

    def requests(self, model: str) -> str:
        return f"{self.prefix}.requests.{model}"

    def priority(self, model: str) -> str:
        """Tail-marked requests forwarded for any consumer of the group to pull first."""
        return f"{self.prefix}.requests.{model}.priority"

    def results(self, model: str) -> str:
        return f"{self.prefix}.results.{model}"

    @property
    def latency_events(self) -> str:
        return f"{self.prefix}.events.latency"

    @property
    def batch_events(self) -> str:
        return f"{self.prefix}.events.batches"

    @property
    def lag_events(self) -> str:
        """Each consumer's periodic lag sample (consumers/lag.py)."""
        return f"{self.prefix}.events.lag"

    @property
    def fleet(self) -> str:
        """Each consumer's beacon: how soon it could serve one more request (consumers/fleet.py)."""
        return f"{self.prefix}.fleet"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}.dlq"

    def group(self, model: str) -> str:
        """The consumer group of `model`'s consumers (not a topic, but named the same way)."""
        return f"{self.prefix}.consumers.{model}"

    def share_group(self, model: str) -> str:
        """The share group of `model`'s consumers in share mode: not the partition group's name, so
        switching `[consumer] group_type` never meets the other kind of group (one kind per group id)."""
        return f"{self.prefix}.share.{model}"

    def for_model(self, model: str) -> tuple[str, str, str]:
        """The model's own topics: requests, priority requests, results."""
        return self.requests(model), self.priority(model), self.results(model)

    @property
    def shared(self) -> tuple[str, ...]:
        """Topics every model writes to: latency, batch and lag events, dead letters."""
        return self.latency_events, self.batch_events, self.lag_events, self.dlq


class SecretRedactor(logging.Filter):
    """Masks known secrets in log records.

    aiokafka logs every request at DEBUG, and a SASL PLAIN authenticate request
    carries the password in its bytes; this filter sits on aiokafka's
    connection logger so turning on DEBUG never prints it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._secrets: set[str] = set()

    def add(self, secret: str) -> None:
        self._secrets.add(secret)
        self._secrets.add(repr(secret.encode())[2:-1])

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._secrets:
            return True
        message = record.getMessage()
        hidden = message
        for secret in self._secrets:
            hidden = hidden.replace(secret, REDACTED)
        if hidden != message:
            record.msg, record.args = hidden, None
        return True


REDACTOR = SecretRedactor()
logging.getLogger("aiokafka.conn").addFilter(REDACTOR)


class ClientOptions(dict[str, Any]):
    """aiokafka keyword arguments whose repr and str never show the password."""

    def __repr__(self) -> str:
        shown = {k: (REDACTED if k in SECRET_OPTIONS and v is not None else v) for k, v in self.items()}
        return f"ClientOptions({shown!r})"

    __str__ = __repr__


def _ssl_context(settings: KafkaSettings) -> ssl.SSLContext:
    context: ssl.SSLContext = create_ssl_context(
        cafile=settings.ssl_cafile,
        certfile=settings.ssl_certfile,
        keyfile=settings.ssl_keyfile,
    )
    return context


def client_options(settings: KafkaSettings) -> ClientOptions:
    """Connection and security kwargs valid for AIOKafkaConsumer, AIOKafkaProducer and the admin client."""
    protocol = settings.security_protocol
    options = ClientOptions(bootstrap_servers=settings.bootstrap_servers, security_protocol=protocol)
    if protocol in ("SSL", "SASL_SSL"):
        options["ssl_context"] = _ssl_context(settings)
    elif settings.ssl_cafile or settings.ssl_certfile:
        raise ConfigError(
            f"kafka.ssl_cafile/ssl_certfile are set but security_protocol is {protocol}; "
            "use SSL or SASL_SSL so they are used"
        )
    if protocol in ("SASL_PLAINTEXT", "SASL_SSL"):
        password = settings.sasl_password
        if not settings.sasl_username or password is None:
            raise ConfigError(
                f"kafka.security_protocol={protocol} needs kafka.sasl_username (or env "
                "BATCHTIDE_KAFKA_USERNAME) and env BATCHTIDE_KAFKA_PASSWORD"
            )
        REDACTOR.add(password)
        options |= {
            "sasl_mechanism": settings.sasl_mechanism,
            "sasl_plain_username": settings.sasl_username,
            "sasl_plain_password": password,
        }
    return options


async def stop_client(stop: Callable[[], Awaitable[None]], what: str, timeout_s: float = CLIENT_STOP_S) -> None:
    """Stop an aiokafka client within `timeout_s`, whatever the broker does.

    With no broker answering, aiokafka's stop() can wait forever (a producer
    flushes what it holds, a consumer looks for its group coordinator), and a
    consumer's stop() re-raises the cancellation of its own fetch tasks when
    one was backing off (aiokafka issue 647). Neither may keep a stopping
    process alive: what it did not commit is redelivered to its group.
    """
    try:
        await asyncio.wait_for(stop(), timeout_s)
    except TimeoutError:
        log.warning("%s did not stop within %.0f s (is the broker down?); left behind", what, timeout_s)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.warning("%s stopped with its own tasks cancelled (is the broker down?)", what)


def topic_partitions(settings: KafkaSettings, models: dict[str, int]) -> dict[str, int]:
    """Every topic the given models need, with its partition count."""
    topics = Topics(settings.topic_prefix)
    wanted: dict[str, int] = {}
    for model, partitions in models.items():
        for name in topics.for_model(model):
            wanted[name] = partitions
    for name in topics.shared:
        wanted[name] = settings.events_partitions
    wanted[topics.fleet] = 1
    return wanted


CLUSTER_REPLICATION = 3
CLUSTER_MIN_INSYNC = 2


def replication(settings: KafkaSettings, brokers: int) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) for new topics on a cluster of `brokers` live brokers.

    "auto" gives 3 and 2 on three or more brokers (one broker may be lost without losing
    or refusing an acks=all write), and one replica per broker below that, with
    min.insync.replicas 1 (on one broker: today's single-broker settings).
    """
    rf = settings.replication_factor
    factor = min(CLUSTER_REPLICATION, brokers) if rf == "auto" else rf
    if factor > brokers:
        raise ConfigError(f"kafka.replication_factor = {factor} but the cluster has {brokers} live broker(s)")
    isr = settings.min_insync_replicas
    insync = (CLUSTER_MIN_INSYNC if factor >= CLUSTER_REPLICATION else 1) if isr == "auto" else isr
    if insync > factor:
        raise ConfigError(f"kafka.min_insync_replicas = {insync} exceeds the replication factor {factor}")
    return factor, insync


def durable_producer() -> dict[str, Any]:
    """Producer options of every batchtide producer: a write is answered once every in-sync replica
    has it (acks=all, so a leader's death cannot take an acknowledged answer with it), and retries
    after a lost acknowledgement cannot write it twice (idempotence)."""
    return {"acks": "all", "enable_idempotence": True}


async def resolve_replication(settings: KafkaSettings) -> KafkaSettings:
    """`settings` with "auto" replication replaced by numbers, counting the cluster's live brokers
    (for clients that create topics of their own, such as faust in the sink)."""
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        factor, insync = replication(settings, len((await admin.describe_cluster())["brokers"]))
    finally:
        await admin.close()
    return dataclasses.replace(settings, replication_factor=factor, min_insync_replicas=insync)


async def ensure_topics(settings: KafkaSettings, models: dict[str, int]) -> dict[str, int]:
    """Create every topic of `models` ({name: partitions}) plus the shared event/DLQ topics.

    Safe to run any number of times, also from several processes at once.
    Returns {topic: partition count} as the broker has them afterwards.
    """
    return await create_topics(settings, topic_partitions(settings, models))


BEACON_RETENTION_MS = 3_600_000
"""Beacons matter for seconds; an hour of them is kept for a person debugging a fleet."""


def topic_configs(name: str) -> dict[str, str]:
    """Per-topic settings batchtide sets at creation (the broker's defaults elsewhere)."""
    if name.endswith(".fleet"):
        return {"retention.ms": str(BEACON_RETENTION_MS)}
    return {}


async def create_topics(settings: KafkaSettings, wanted: dict[str, int]) -> dict[str, int]:
    """Create missing topics ({name: partitions}) and grow existing ones that have fewer partitions.

    An existing topic is never shrunk or recreated (that would lose data).
    """
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        factor, insync = replication(settings, len((await admin.describe_cluster())["brokers"]))
        response = await admin.create_topics(
            [
                NewTopic(name, count, factor, topic_configs={"min.insync.replicas": str(insync), **topic_configs(name)})
                for name, count in wanted.items()
            ]
        )
        for topic, code, message in _topic_errors(response):
            if code and for_code(code) is not TopicAlreadyExistsError:
                raise for_code(code)(f"could not create topic {topic}: {message}")
        existing = await _settled_partition_counts(admin, dict.fromkeys(wanted, 1))
        grow = {name: NewPartitions(wanted[name]) for name, count in existing.items() if count < wanted[name]}
        if grow:
            await admin.create_partitions(grow)
            existing = await _settled_partition_counts(admin, wanted)
    finally:
        await admin.close()
    await _known_to_every_broker(settings, wanted)
    return existing


async def _known_to_every_broker(settings: KafkaSettings, wanted: dict[str, int], timeout_s: float = 15.0) -> None:
    """Wait until every live broker's metadata lists each topic with its partitions.

    On a cluster each broker learns of a new topic from the controller in its
    own time; a client that asks another broker a moment after the create gets
    UNKNOWN_TOPIC_OR_PARTITION (aiokafka's consumer start() then fails). On
    one broker this returns at once.
    """
    client = AIOKafkaClient(request_timeout_ms=10_000, **client_options(settings))
    await client.bootstrap()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for broker in sorted(client.cluster.brokers(), key=lambda b: b.nodeId):
            while loop.time() < deadline:
                try:
                    response = await client.send(broker.nodeId, MetadataRequest(sorted(wanted)))
                except Exception:
                    break
                view = ClusterMetadata()
                view.update_metadata(response)
                if all(len(view.partitions_for_topic(name) or ()) >= count for name, count in wanted.items()):
                    break
                await asyncio.sleep(0.05)
    finally:
        await client.close()


async def list_topics(settings: KafkaSettings) -> dict[str, int]:
    """{topic: partitions} of every non-internal topic on the cluster."""
    admin = AIOKafkaAdminClient(**client_options(settings))
    await admin.start()
    try:
        names = [name for name in await admin.list_topics() if not name.startswith("__")]
        return await _partition_counts(admin, names) if names else {}
    finally:
        await admin.close()


def _topic_errors(response: Any) -> Iterable[tuple[str, int, str | None]]:
    for entry in response.topic_errors:
        topic, code = entry[0], entry[1]
        message = entry[2] if len(entry) > 2 else None
        yield topic, code, message


async def _partition_counts(admin: AIOKafkaAdminClient, topics: Iterable[str]) -> dict[str, int]:
    described = await admin.describe_topics(list(topics))
    return {t["topic"]: len(t["partitions"]) for t in described if t["error_code"] == 0}


async def _settled_partition_counts(
    admin: AIOKafkaAdminClient, wanted: dict[str, int], timeout_s: float = 10.0
) -> dict[str, int]:
    """Partition counts once metadata shows every topic with at least its wanted partitions.

    Metadata lags a create by a few milliseconds; polling hides that from callers.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        counts = await _partition_counts(admin, wanted)
        settled = all(counts.get(name, 0) >= count for name, count in wanted.items())
        if settled or loop.time() > deadline:
            return counts
        await asyncio.sleep(0.05)


async def stable_group_size(settings: KafkaSettings, group: str) -> int:
    """Members of `group` once it is Stable; 0 while it is empty, rebalancing, or its
    coordinator is not ready yet (a fresh broker has none for a moment)."""
    admin = AIOKafkaAdminClient(request_timeout_ms=10_000, **client_options(settings))
    await admin.start()
    try:
        responses = await admin.describe_consumer_groups([group])
    except Exception:
        return 0
    finally:
        await admin.close()
    members = 0
    for response in responses:
        for description in response.groups:
            error_code, state = description[0], description[2]
            if error_code == 0 and state == "Stable":
                members += len(description[5])
    return members
