"""CLI command group `batchtide local`: a local Kafka broker or KRaft cluster for development."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Annotated

import typer

from pipeline.core.config import KafkaSettings

DEFAULT_DATA_DIR = Path("var/kafka")
DEFAULT_PORT = 9092
STATE_FILE = "state.json"

local_app = typer.Typer(
    help="Run a local Kafka broker, or a KRaft cluster of them, for development.", no_args_is_help=True
)

DataDirOption = Annotated[Path, typer.Option("--data-dir", help="Broker data directory (topics, offsets, logs).")]


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(1)


@local_app.command("fetch")
def fetch() -> None:
    """Resolve Apache Kafka's jars into ~/.cache/batchtide and record the JVM class archive (once)."""
    from pipeline.tools.devtools.localkafka import KafkaSetupError, ensure_class_archive, ensure_kafka_jars

    started = time.monotonic()
    try:
        libs = ensure_kafka_jars()
        typer.echo(
            f"Apache Kafka {libs.parent.name.removeprefix('kafka-')} jars: {libs} ({time.monotonic() - started:.1f} s)"
        )
        started = time.monotonic()
        archive = ensure_class_archive()
    except KafkaSetupError as e:
        raise _fail(str(e)) from None
    typer.echo(f"class archive: {archive or 'off'} ({time.monotonic() - started:.1f} s)")


@local_app.command("bench")
def bench(runs: Annotated[int, typer.Option(help="Fresh brokers to start.")] = 3) -> None:
    """Measure broker start time: cold (format + first start) and warm (restart on the same dir)."""
    import statistics
    import tempfile

    from pipeline.tools.devtools.localkafka import LocalKafka, cds_archive

    cold: list[float] = []
    warm: list[float] = []
    stop: list[float] = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="kafka-bench-") as scratch:
            broker = LocalKafka(Path(scratch))
            broker.start()
            cold.append(broker.last_start_s or 0.0)
            began = time.monotonic()
            broker.stop()
            stop.append(time.monotonic() - began)
            broker.start()
            warm.append(broker.last_start_s or 0.0)
            broker.stop()
    sharing = os.environ.get("BATCHTIDE_KAFKA_CDS", "1") != "0" and cds_archive().is_file()
    typer.echo(f"class archive: {'on' if sharing else 'off'}; load average {os.getloadavg()[0]:.1f}")
    for name, values in (("cold start (format + start)", cold), ("warm restart", warm), ("clean stop", stop)):
        typer.echo(
            f"{name:28s} median {statistics.median(values):5.2f} s  "
            f"min {min(values):5.2f} s  max {max(values):5.2f} s  (n={len(values)})"
        )


@local_app.command("up")
def up(
    data_dir: DataDirOption = DEFAULT_DATA_DIR,
    port: Annotated[
        int | None,
        typer.Option(
            help="Client port (a cluster: of node 1, the others follow); default: the data dir's previous "
            "port, else 9092 if free, else any free port."
        ),
    ] = None,
    brokers: Annotated[
        int, typer.Option("--brokers", min=1, help="Brokers: 1 (a single node) or a KRaft cluster of N nodes.")
    ] = 1,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the broker(s) to answer.")] = 90.0,
) -> None:
    """Start the broker (or a cluster of them) in the background; it keeps running after this command exits."""
    from pipeline.tools.devtools.localcluster import LocalCluster, is_cluster_dir
    from pipeline.tools.devtools.localkafka import KafkaSetupError, LocalKafka, port_is_free

    if brokers > 1 or is_cluster_dir(data_dir):
        try:
            cluster = LocalCluster(data_dir, brokers=brokers if brokers > 1 else LocalCluster.open(data_dir).size)
        except KafkaSetupError as e:
            raise _fail(str(e)) from None
        if (
            port is None
            and not is_cluster_dir(data_dir)
            and all(port_is_free(DEFAULT_PORT + i) for i in range(cluster.size))
        ):
            port = DEFAULT_PORT
        cluster = LocalCluster(data_dir, brokers=cluster.size, first_port=port)
        started = time.monotonic()
        try:
            cluster.start(timeout_s=timeout, detached=True)
        except KafkaSetupError as e:
            raise _fail(str(e)) from None
        state: dict[str, object] = {
            "pids": [node.pid for node in cluster.nodes],
            "bootstrap": cluster.bootstrap,
            "data_dir": str(cluster.data_dir),
        }
        (cluster.data_dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
        typer.echo(
            f"Apache Kafka {cluster.nodes[0].kafka_version} cluster of {cluster.size} "
            f"up in {time.monotonic() - started:.1f} s"
        )
        for node in cluster.nodes:
            typer.echo(f"  node {node.node_id}: pid {node.pid}, {node.bootstrap}, logs {node.log_file}")
        typer.echo(f"export BATCHTIDE_KAFKA_BOOTSTRAP={cluster.bootstrap}")
        return
    broker = LocalKafka(data_dir)
    if broker.is_running:
        typer.echo(f"already running: pid {broker.pid}, bootstrap {broker.bootstrap}")
        return
    if port is None and not (data_dir / "cluster.json").is_file() and port_is_free(DEFAULT_PORT):
        port = DEFAULT_PORT
    broker = LocalKafka(data_dir, port=port)
    try:
        broker.start(timeout_s=timeout, detached=True)
    except KafkaSetupError as e:
        raise _fail(str(e)) from None
    state = {"pid": broker.pid, "bootstrap": broker.bootstrap, "data_dir": str(broker.data_dir)}
    (broker.data_dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
    typer.echo(
        f"Apache Kafka {broker.kafka_version} up in {broker.last_start_s:.1f} s: pid {broker.pid}, "
        f"logs {broker.log_file}"
    )
    typer.echo(f"export BATCHTIDE_KAFKA_BOOTSTRAP={broker.bootstrap}")


@local_app.command("down")
def down(data_dir: DataDirOption = DEFAULT_DATA_DIR) -> None:
    """Stop the broker (every node of a cluster) cleanly (SIGTERM, wait); its data stays for the next `up`."""
    from pipeline.tools.devtools.localcluster import LocalCluster, is_cluster_dir
    from pipeline.tools.devtools.localkafka import LocalKafka

    nodes = LocalCluster.open(data_dir).nodes if is_cluster_dir(data_dir) else [LocalKafka(data_dir)]
    pids = [node.pid for node in nodes if node.is_running]
    if not pids:
        typer.echo("not running")
        return
    if len(nodes) > 1:
        LocalCluster.open(data_dir).stop()
    else:
        nodes[0].stop()
    (Path(data_dir) / STATE_FILE).unlink(missing_ok=True)
    typer.echo(f"stopped pid {', '.join(str(p) for p in pids)}")


@local_app.command("status")
def status(data_dir: DataDirOption = DEFAULT_DATA_DIR) -> None:
    """Is the broker running, where, and which topics does it hold (a cluster: controller, leaders, ISR)."""
    from pipeline.core.kafka.client import list_topics
    from pipeline.tools.devtools.localcluster import is_cluster_dir
    from pipeline.tools.devtools.localkafka import LocalKafka

    if is_cluster_dir(data_dir):
        _cluster_status(data_dir)
        return
    broker = LocalKafka(data_dir)
    if not broker.is_running:
        typer.echo(f"not running (data dir {broker.data_dir})")
        raise typer.Exit(3)
    typer.echo(
        f"running: Apache Kafka {broker.recorded_version}, pid {broker.pid}, bootstrap {broker.bootstrap}, "
        f"data dir {broker.data_dir}"
    )
    counts = asyncio.run(list_topics(KafkaSettings(bootstrap_servers=broker.bootstrap)))
    typer.echo(f"topics ({len(counts)}):")
    for name, partitions in sorted(counts.items()):
        typer.echo(f"  {name}  partitions={partitions}")


def _cluster_status(data_dir: Path) -> None:
    """Nodes, the active controller, and every partition's leader and ISR, straight from the cluster."""
    from pipeline.core.kafka.cluster import PartitionState, Quorum, live_brokers, partition_states, quorum
    from pipeline.tools.devtools.localcluster import LocalCluster

    cluster = LocalCluster.open(data_dir)
    running = [node for node in cluster.nodes if node.is_running]
    if not running:
        typer.echo(f"not running (cluster of {cluster.size}, data dir {cluster.data_dir})")
        raise typer.Exit(3)
    settings = KafkaSettings(bootstrap_servers=",".join(node.bootstrap for node in running))

    async def look() -> tuple[list[int], Quorum | str, list[PartitionState]]:
        alive = await live_brokers(settings)
        try:
            leader: Quorum | str = await quorum(settings)
        except Exception as e:
            leader = f"unknown ({e!r})"
        return alive, leader, await partition_states(settings)

    alive, leader, states = asyncio.run(look())
    typer.echo(
        f"cluster of {cluster.size} (Apache Kafka {cluster.nodes[0].recorded_version}), data dir {cluster.data_dir}, "
        f"bootstrap {cluster.bootstrap}"
    )
    for node in cluster.nodes:
        state = "running" if node.is_running else "stopped"
        fenced = "" if node.node_id in alive or not node.is_running else " (not in metadata: fenced?)"
        typer.echo(f"  broker {node.node_id}: {state}, pid {node.pid}, {node.bootstrap}{fenced}")
    if isinstance(leader, str):
        typer.echo(f"controller leader: {leader}")
    else:
        typer.echo(f"controller leader: node {leader.leader} (epoch {leader.epoch}, voters {list(leader.voters)})")
    topics = sorted({s.topic for s in states})
    typer.echo(f"topics ({len(topics)}):")
    for topic in topics:
        mine = [s for s in states if s.topic == topic]
        under = sum(1 for s in mine if s.under_replicated)
        typer.echo(f"  {topic}  partitions={len(mine)}" + (f"  under-replicated={under}" if under else ""))
        for s in mine:
            typer.echo(f"    p{s.partition}  leader={s.leader}  replicas={list(s.replicas)}  isr={list(s.isr)}")


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.add_typer(local_app, name="local")
