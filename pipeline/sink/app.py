"""The sink: a faust-streaming app that loads latency, batch and lag events into ClickHouse.

Three agents, one per events topic (`<prefix>.events.latency`,
`<prefix>.events.batches`, `<prefix>.events.lag`), run with faust's automatic acks turned off. Each
event is decoded (msgspec, the wire contract in schemas/messages.py) and
handed with its ack to a `Loader` (pipeline/sink/loader.py), which inserts
in batches and acks an event only after its batch is stored. faust commits
only acked offsets, so a crash or a ClickHouse outage replays events rather
than losing them, and the writer (pipeline/core/store/writer.py) drops replays
that are already stored. Undecodable records are logged, counted and acked:
they can never be stored, and must not stall the partition.

ClickHouse is reached through `pipeline.core.store.connection.connect` (embedded chDB
when no URL is configured, HTTP otherwise). A failed insert drops the client;
the next attempt reconnects.

Beside the agents, the sink samples every model's consumer group from the
broker (pipeline/core/store/group_lag.py: lag, lag age, members, and the
dead-letter topic's end offsets) into `consumer_lag` every
`[clickhouse] group_lag_interval_ms`, so a model whose consumers are all
gone is still seen. Its stop is bounded by `sink_stop_timeout_s`, also with
the broker gone (pipeline/sink/stop.py).

The sink needs no supervisor: `wait_until_ready` lets it start while
ClickHouse or Kafka is down. It retries with capped exponential backoff,
logging what it waits for, until ClickHouse takes the schema and the broker
has the events topics; events produced meanwhile wait in Kafka.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faust
import msgspec
from clickhouse_connect.driver.client import Client

from pipeline.core.config import Config, KafkaSettings
from pipeline.core.kafka.client import Topics, create_topics, resolve_replication
from pipeline.core.store.connection import connect as connect_clickhouse
from pipeline.core.store.connection import describe
from pipeline.core.store.group_lag import GroupLagSampler, GroupSample
from pipeline.core.store.lag_writer import insert_group_samples, insert_lag_events
from pipeline.core.store.migrations import Layout, migrate
from pipeline.core.store.writer import insert_batch_events, insert_latency_events
from pipeline.sink.loader import Loader
from pipeline.sink.stop import bound_consumer_thread
from schemas.messages import BatchEvent, LagEvent, LatencyEvent

log = logging.getLogger("batchtide.sink")
STATS_INTERVAL_S = 10.0
READY_ATTEMPT_S = 15.0
"""One attempt to reach ClickHouse or Kafka at start-up gives up after this long and is retried."""
METADATA_MAX_AGE_S = 5.0
"""How stale the sink's consumer may let its view of partition leaders get (aiokafka's default: 5 min).

After a rebalance, a partition with no committed offset (faust's own
`__assignor-__leader` topic always; an events partition that never had a
record) gets its position from a ListOffsets request to the leader aiokafka
believes in. When that leader has moved (a frozen or restarted broker), the
answer is NotLeaderForPartition, which aiokafka retries every 100 ms without
refreshing its metadata, and while any partition of a broker awaits such a
reset aiokafka sends that broker no fetch at all: every events partition
it believes the old leader holds stops being read, silently, until the
periodic metadata refresh (the Java client refreshes on this error:
KAFKA-9535). A refresh every few seconds bounds that stall to seconds."""


async def wait_until_ready(
    config: Config,
    layout: Layout,
    *,
    connect: Callable[[], Client] | None = None,
    first_s: float = 0.5,
    max_s: float = 30.0,
) -> None:
    """Return once ClickHouse has the schema (`layout`) and Kafka has the events topics; until
    then retry with backoff from `first_s` doubling to `max_s`, saying what is missing."""
    ch, kafka = config.clickhouse, config.kafka
    opener = connect or (lambda: connect_clickhouse(ch))

    def migrated() -> None:
        client = opener()
        try:
            migrate(client, layout)
        finally:
            client.close()

    topics = Topics(kafka.topic_prefix)
    events = {topics.latency_events: kafka.events_partitions, topics.batch_events: kafka.events_partitions}
    await _retry(f"ClickHouse ({describe(ch)})", lambda: asyncio.to_thread(migrated), first_s, max_s)
    await _retry(f"Kafka at {kafka.bootstrap_servers}", lambda: create_topics(kafka, events), first_s, max_s)


async def _retry(what: str, attempt: Callable[[], Any], first_s: float, max_s: float) -> None:
    delay, failures = first_s, 0
    while True:
        try:
            await asyncio.wait_for(attempt(), READY_ATTEMPT_S)
        except Exception as e:
            failures += 1
            log.warning("sink waiting for %s: %s; next try in %.1f s", what, str(e) or type(e).__name__, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_s)
            continue
        if failures:
            log.info("sink: %s is back after %d failed attempts", what, failures)
        return


class StoreConnection:
    """The sink's one ClickHouse client, opened lazily and dropped after a failure."""

    def __init__(self, connect: Callable[[], Client]) -> None:
        self._connect = connect
        self._client: Client | None = None
        self._lock = threading.Lock()

    def run(self, work: Callable[[Client], int]) -> int:
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            try:
                return work(self._client)
            except Exception:
                self._drop()
                raise

    def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass

    def close(self) -> None:
        with self._lock:
            self._drop()


def broker_credentials(settings: KafkaSettings) -> faust.types.auth.CredentialsT | None:
    """faust credentials from the same KafkaSettings the rest of the pipeline uses."""
    from pipeline.core.kafka.client import client_options

    options = client_options(settings)
    protocol = options["security_protocol"]
    if protocol.startswith("SASL"):
        return faust.SASLCredentials(
            username=options["sasl_plain_username"],
            password=options["sasl_plain_password"],
            mechanism=options["sasl_mechanism"],
            ssl_context=options.get("ssl_context"),
        )
    if protocol == "SSL":
        return faust.SSLCredentials(options["ssl_context"])
    return None


@dataclass
class Sink:
    """The faust app plus its loaders and group sampler: `faust.Worker(sink.app)` runs it (`batchtide sink`),
    `await sink.app.start()` / `stop()` embeds it in a running event loop (tests, benchmarks)."""

    app: faust.App
    latency: Loader[LatencyEvent]
    batches: Loader[BatchEvent]
    store: StoreConnection
    topics: Topics
    rejected: int = 0
    lags: Loader[LagEvent] | None = None
    groups: Loader[GroupSample] | None = None
    sampler: GroupLagSampler | None = None

    def lag(self) -> dict[str, int]:
        """Records not yet read, and not yet committed (i.e. not yet stored), on assigned partitions."""
        consumer: Any = self.app.consumer  # faust's Consumer keeps the offsets below privately: ConsumerT lacks them
        unread = uncommitted = 0
        for tp in consumer.assignment():
            high = consumer.highwater(tp)
            if high is None:
                continue
            read = consumer._read_offset.get(tp)
            committed = consumer._committed_offset.get(tp)
            unread += max(high - (read + 1 if read is not None else 0), 0)
            uncommitted += max(high - (committed if committed is not None else 0), 0)
        return {"unread": unread, "uncommitted": uncommitted}

    def status_line(self) -> str:
        lat, bat = self.latency.stats, self.batches.stats
        lag = self.lag()
        state = "ClickHouse DOWN, retrying" if lat.failing_since or bat.failing_since else "ok"
        return (
            f"sink {state}: latency inserted {lat.inserted} (dupes {lat.duplicates}), buffered {self.latency.buffered}; "
            f"batches inserted {bat.inserted} (dupes {bat.duplicates}), buffered {self.batches.buffered}; "
            f"rejected {self.rejected}; lag unread {lag['unread']}, uncommitted {lag['uncommitted']}"
            + (f"; group lag samples {self.sampler.samples} (failed {self.sampler.failures})" if self.sampler else "")
        )


async def _stored() -> None:
    """The ack of a broker-side sample: it came from no topic, so nothing is committed."""


def _replication_factor(kafka: KafkaSettings) -> int:
    """faust creates a topic of its own (its assignor's leader topic) and needs a number: "auto"
    is resolved against the cluster here (`batchtide sink` resolves it before building)."""
    if kafka.replication_factor != "auto":
        return kafka.replication_factor
    with ThreadPoolExecutor(max_workers=1) as pool:
        resolved = pool.submit(asyncio.run, resolve_replication(kafka)).result()
    return int(resolved.replication_factor)


def sink_group(topic_prefix: str) -> str:
    """The sink's app id, and so its consumer group: one per topic prefix."""
    return f"{topic_prefix}-sink"


def build_sink(
    config: Config,
    *,
    connect: Callable[[], Client] | None = None,
    app_id: str | None = None,
    datadir: str | None = None,
) -> Sink:
    """Wire the faust app. `connect` opens a ClickHouse client (default: from config.clickhouse)."""
    kafka, ch = config.kafka, config.clickhouse
    topics = Topics(kafka.topic_prefix)
    app_id = app_id or sink_group(kafka.topic_prefix)
    app = faust.App(
        app_id,
        broker=[f"kafka://{server.strip()}" for server in kafka.bootstrap_servers.split(",")],
        broker_credentials=broker_credentials(kafka),
        value_serializer="raw",
        key_serializer="raw",
        store="memory://",
        web_enabled=False,
        autodiscover=False,
        datadir=datadir or str(Path(tempfile.gettempdir()) / f"batchtide-faust-{app_id}"),
        topic_partitions=kafka.events_partitions,
        topic_replication_factor=_replication_factor(kafka),
        consumer_auto_offset_reset="earliest",
        broker_commit_interval=1.0,
        # faust's default (60 s) leaves a restarted sink's partitions unread for a
        # minute after a crash; 10 s is Kafka's own consumer default.
        broker_session_timeout=10.0,
        consumer_metadata_max_age_ms=int(METADATA_MAX_AGE_S * 1000),
        stream_buffer_maxsize=max(ch.insert_batch_size, 1000),
        # Unacked events are simply redelivered to whoever owns the partition next;
        # waiting for them at a rebalance or stop would hang for as long as ClickHouse is down.
        stream_wait_empty=False,
    )
    store = StoreConnection(connect or (lambda: connect_clickhouse(ch)))
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clickhouse-insert")
    database = ch.database
    common: dict[str, Any] = {
        "executor": executor,
        "batch_size": ch.insert_batch_size,
        "interval_s": ch.insert_interval_ms / 1000,
        "max_buffer": max(ch.max_buffer_events, ch.insert_batch_size),
        "backoff_max_s": ch.insert_retry_max_s,
    }
    latency: Loader[LatencyEvent] = Loader(
        "request_latency", lambda b: store.run(lambda c: insert_latency_events(c, database, b)), **common
    )
    batches: Loader[BatchEvent] = Loader(
        "batches", lambda b: store.run(lambda c: insert_batch_events(c, database, b)), **common
    )
    lags: Loader[LagEvent] = Loader(
        "consumer_lag", lambda b: store.run(lambda c: insert_lag_events(c, database, b)), **common
    )
    groups: Loader[GroupSample] = Loader(
        "consumer_lag (broker)", lambda b: store.run(lambda c: insert_group_samples(c, database, b)), **common
    )
    sampler = None
    if ch.group_lag_interval_ms > 0:
        sampler = GroupLagSampler(
            kafka,
            sorted(config.models),
            ch.group_lag_interval_ms / 1000,
            lambda s: groups.put(s, _stored),
            share=config.consumer.group_type == "share",
        )
    sink = Sink(
        app=app, latency=latency, batches=batches, store=store, topics=topics, lags=lags, groups=groups, sampler=sampler
    )

    def agent_for(loader: Loader[Any], kind: type) -> Callable[[Any], Any]:
        decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(kind)

        async def consume(stream: Any) -> None:
            stream.enable_acks = False
            async for event in stream.events():
                try:
                    value = decoder.decode(event.value)
                except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as e:
                    sink.rejected += 1
                    log.error("%s: dropping undecodable record at %s@%s: %s",
                              loader.name, event.message.tp, event.message.offset, e)  # fmt: skip
                    await stream.ack(event)
                    continue
                await loader.put(value, functools.partial(stream.ack, event))

        consume.__name__ = f"load_{loader.name}"
        return consume

    latency_topic = app.topic(topics.latency_events, value_type=bytes, value_serializer="raw")
    batch_topic = app.topic(topics.batch_events, value_type=bytes, value_serializer="raw")
    app.agent(latency_topic, name=f"{app_id}.load_request_latency")(agent_for(latency, LatencyEvent))
    app.agent(batch_topic, name=f"{app_id}.load_batches")(agent_for(batches, BatchEvent))
    lag_topic = app.topic(topics.lag_events, value_type=bytes, value_serializer="raw")
    app.agent(lag_topic, name=f"{app_id}.load_consumer_lag")(agent_for(lags, LagEvent))

    @app.task
    async def run_loaders() -> None:
        bound_consumer_thread(app, ch.sink_stop_timeout_s)
        await asyncio.gather(
            latency.run(), batches.run(), lags.run(), groups.run(), *([sampler.run()] if sampler else [])
        )

    @app.timer(interval=STATS_INTERVAL_S)
    async def report_progress() -> None:
        log.info(sink.status_line())

    return sink
