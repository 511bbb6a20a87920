"""Benchmarks of the latency store (commands print reports; they are never timed tests).

* `bench_report`: seed up to N rows, then time every report query several
  times over the whole seeded range and print p50 / p99 / max per query.
* `bench_sink`: produce seeded events to fresh topics on the configured
  broker, run the faust sink in this process until every row is stored, and
  print the insert rate (events/s end to end: Kafka -> faust -> ClickHouse).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable

import numpy as np

from pipeline.core.config import ClickHouseSettings, Config
from pipeline.core.store.connection import connect, scalar_int
from pipeline.core.store.migrations import Layout, migrate
from pipeline.core.store.queries import REPORT_QUERIES
from pipeline.core.store.seed import seed_database
from pipeline.tools.views.report import pick_interval_ms, run_query

Echo = Callable[[str], None]


def bench_report(settings: ClickHouseSettings, *, rows: int, repeat: int, echo: Echo, since: str | None = None) -> None:
    client = connect(settings)
    database = settings.database
    try:
        migrate(client, Layout(database, ttl_days=settings.ttl_days, rollup_ttl_days=settings.rollup_ttl_days))
        have = scalar_int(client, f"SELECT count() FROM {database}.request_latency")
        if have < rows:
            started = time.perf_counter()
            seed_database(client, database, rows - have, seed=int(time.time()))
            echo(f"seeded {rows - have:,} rows in {time.perf_counter() - started:.1f} s")
        lo, hi, count = client.query(
            f"SELECT toUnixTimestamp64Milli(min(enqueue_time)), toUnixTimestamp64Milli(max(enqueue_time)), count() "
            f"FROM {database}.request_latency"
        ).result_rows[0]
        client.close()
        client = connect(settings, database=database)
        interval = pick_interval_ms(hi - lo)
        echo(f"{count:,} rows, range {(hi - lo) / 60000:.1f} min, buckets {interval / 1000:g} s, {repeat} runs each")
        echo(f"{'query':28} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9} {'rows':>6}")
        totals = np.zeros(repeat)
        for name in REPORT_QUERIES:
            times = []
            for run in range(repeat):
                started = time.perf_counter()
                result = run_query(
                    client, name, time_from_ms=lo, time_to_ms=hi + 1000, interval_ms=interval, model=None
                )
                times.append((time.perf_counter() - started) * 1000)
                totals[run] += times[-1]
            p50, p99 = np.percentile(times, [50, 99])
            echo(f"{name:28} {p50:9.1f} {p99:9.1f} {max(times):9.1f} {len(result):6}")
        p50, p99 = np.percentile(totals, [50, 99])
        echo(f"{'whole report':28} {p50:9.1f} {p99:9.1f} {totals.max():9.1f}")
    finally:
        client.close()


async def bench_sink(config: Config, *, events: int, echo: Echo) -> None:
    import msgspec
    from aiokafka import AIOKafkaProducer

    from pipeline.core.kafka.client import Topics, client_options, create_topics, durable_producer, resolve_replication
    from pipeline.core.store.seed import batch_events, generate, latency_events
    from pipeline.sink.app import build_sink

    prefix = f"bench-sink-{uuid.uuid4().hex[:8]}"
    kafka = await resolve_replication(dataclasses.replace(config.kafka, topic_prefix=prefix))
    database = f"bench_sink_{uuid.uuid4().hex[:8]}"
    ch = dataclasses.replace(config.clickhouse, database=database)
    topics = Topics(prefix)
    await create_topics(
        kafka, {topics.latency_events: kafka.events_partitions, topics.batch_events: kafka.events_partitions}
    )
    client = connect(ch)
    migrate(client, Layout(database))
    encoder = msgspec.json.Encoder()
    producer = AIOKafkaProducer(**client_options(kafka), **durable_producer(), linger_ms=20, max_batch_size=1 << 20)
    await producer.start()
    produced = batches = 0
    try:
        for chunk in generate(events, duration_ms=600_000):
            for event in latency_events(chunk):
                await producer.send(topics.latency_events, encoder.encode(event))
            produced += chunk.rows
            for batch in batch_events(chunk):
                await producer.send(topics.batch_events, encoder.encode(batch))
                batches += 1
        await producer.flush()
    finally:
        await producer.stop()
    echo(f"produced {produced:,} latency + {batches:,} batch events to {prefix}.events.*")
    sink = build_sink(
        dataclasses.replace(config, kafka=kafka, clickhouse=ch), connect=lambda: connect(ch, database=database)
    )
    started, cpu_started = time.monotonic(), time.process_time()
    await sink.app.start()
    try:
        # Progress from the sink's own counters: polling the engine from this thread would compete with it.
        while sink.latency.stats.inserted + sink.batches.stats.inserted < produced + batches:
            if time.monotonic() - started > 600:
                break
            await asyncio.sleep(0.05)
        elapsed, cpu = time.monotonic() - started, time.process_time() - cpu_started
    finally:
        await sink.app.stop()
        sink.store.close()
    stored = scalar_int(client, f"SELECT count() FROM {database}.request_latency")
    stored += scalar_int(client, f"SELECT count() FROM {database}.batches")
    echo(
        f"sink stored {stored:,} rows in {elapsed:.1f} s wall (incl. ~1 s group join): {stored / elapsed:,.0f} events/s; "
        f"{cpu:.1f} CPU s in this process (faust + chDB engine): {stored / max(cpu, 1e-9):,.0f} events per CPU-second "
        f"(batch size {ch.insert_batch_size}, chDB at {ch.data_dir})"
    )
    client.command(f"DROP DATABASE IF EXISTS {database}")
    client.close()
