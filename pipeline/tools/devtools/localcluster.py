"""A local Kafka cluster: N `LocalKafka` nodes (broker + controller each) sharing one KRaft quorum.

The nodes are the single broker's own code (`localkafka.py`); what makes them a
cluster is their `cluster.json`, written here once: one cluster id, each
node's id and ports, the quorum's voters, and the replication their internal
topics (offsets, transaction state) get. Node N lives in `<data_dir>/node-N`;
`<data_dir>/quorum.json` records the layout so a restart comes back on the
same addresses.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pipeline.tools.devtools.broker_config import kafka_uuid
from pipeline.tools.devtools.broker_process import free_port, port_is_free, run_sync
from pipeline.tools.devtools.kafka_jars import KafkaSetupError
from pipeline.tools.devtools.localkafka import CLUSTER_FILE, LocalKafka

QUORUM_FILE = "quorum.json"
NODE_HEAP_MB = 320
"""Heap of each node: three nodes (~0.5 GB resident each) fit beside the consumers on a small machine."""
CLUSTER_REPLICAS = 3
CLUSTER_MIN_ISR = 2
"""What a cluster of three or more gives its internal topics (and its default for new topics)."""


def is_cluster_dir(data_dir: Path | str) -> bool:
    """Whether `data_dir` holds a cluster (rather than a single broker)."""
    return (Path(data_dir) / QUORUM_FILE).is_file()


class LocalCluster:
    """`brokers` KRaft nodes on loopback, every one both broker and controller.

    `first_port` puts the client listeners on first_port, first_port+1, ...
    (default: free ports); the layout is fixed by the first start.
    """

    def __init__(self, data_dir: Path | str, brokers: int = 3, first_port: int | None = None) -> None:
        if brokers < 1:
            raise KafkaSetupError(f"a cluster needs at least one broker (got {brokers})")
        self.data_dir = Path(data_dir).resolve()
        layout = self._load_layout()
        if layout is not None and len(layout["nodes"]) != brokers:
            raise KafkaSetupError(
                f"{self.data_dir} holds a cluster of {len(layout['nodes'])} brokers; use another data dir for {brokers}"
            )
        self.size = brokers
        self._first_port = first_port
        self.nodes = [LocalKafka(self.data_dir / f"node-{i}") for i in range(1, brokers + 1)]

    def __repr__(self) -> str:
        running = [n.node_id for n in self.nodes if n.is_running]
        return f"LocalCluster({str(self.data_dir)!r}, brokers={self.size}, running={running})"

    @classmethod
    def open(cls, data_dir: Path | str) -> LocalCluster:
        """The cluster already laid out in `data_dir`."""
        layout = json.loads((Path(data_dir) / QUORUM_FILE).read_text())
        return cls(data_dir, brokers=len(layout["nodes"]))

    # -- layout ----------------------------------------------------------------

    @property
    def _layout_file(self) -> Path:
        return self.data_dir / QUORUM_FILE

    def _load_layout(self) -> dict[str, Any] | None:
        return json.loads(self._layout_file.read_text()) if self._layout_file.is_file() else None

    def _ports(self) -> list[tuple[int, int]]:
        """(client, controller) port of every node, all distinct."""
        taken: set[int] = set()
        ports: list[tuple[int, int]] = []
        for i in range(self.size):
            client = self._first_port + i if self._first_port else free_port()
            if self._first_port and not port_is_free(client):
                raise KafkaSetupError(f"port {client} on 127.0.0.1 is taken")
            while client in taken:
                client = free_port()
            taken.add(client)
            controller = free_port()
            while controller in taken:
                controller = free_port()
            taken.add(controller)
            ports.append((client, controller))
        return ports

    def _prepare(self) -> None:
        """Write the layout and every node's cluster.json, once."""
        if self._layout_file.is_file():
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cluster_id = kafka_uuid()
        ports = self._ports()
        voters = ",".join(f"{i}@127.0.0.1:{cport}" for i, (_, cport) in enumerate(ports, start=1))
        replicas = min(CLUSTER_REPLICAS, self.size)
        min_isr = CLUSTER_MIN_ISR if replicas >= CLUSTER_REPLICAS else 1
        for node, (port, cport) in zip(self.nodes, ports, strict=True):
            node.data_dir.mkdir(parents=True, exist_ok=True)
            identity = {
                "cluster_id": cluster_id,
                "node_id": int(node.data_dir.name.split("-")[1]),
                "port": port,
                "controller_port": cport,
                "voters": voters,
                "replicas": replicas,
                "min_insync_replicas": min_isr,
                "heap_mb": NODE_HEAP_MB,
                "sasl": False,
                "tls": False,
                "internal_password": "",
                "kafka_version": self.nodes[0].kafka_version,
            }
            (node.data_dir / CLUSTER_FILE).write_text(json.dumps(identity, indent=2))
        layout = {"cluster_id": cluster_id, "nodes": [{"node_id": i, "port": p} for i, (p, _) in enumerate(ports, 1)]}
        self._layout_file.write_text(json.dumps(layout, indent=2) + "\n")

    # -- addresses ---------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        """Every node's client address, comma-separated (clients need only one to answer)."""
        return ",".join(node.bootstrap for node in self.nodes)

    def node(self, node_id: int) -> LocalKafka:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(f"no node {node_id} in {self!r}")

    @property
    def is_running(self) -> bool:
        return any(node.is_running for node in self.nodes)

    # -- lifecycle -----------------------------------------------------------------

    def start(self, timeout_s: float = 120.0, *, detached: bool = False) -> None:
        """Start every node that is not running and return once each answers metadata.

        All JVMs are launched before any is waited for: no node is ready until a
        majority of the quorum runs. `detached` as for LocalKafka (otherwise
        every node dies with this process, see LIFELINE).
        """
        self._prepare()
        started = time.monotonic()
        waiting = [node for node in self.nodes if not node.is_running]
        try:
            for node in waiting:
                node.launch(detached=detached)
            for node in waiting:
                node.wait_ready(max(timeout_s - (time.monotonic() - started), 1.0), started=started)
            if waiting:
                self._wait_all_listed(started + timeout_s)
        except BaseException:
            self.kill()
            raise

    def _wait_all_listed(self, deadline: float) -> None:
        """Until every node's metadata lists every node: each one learns of the others' registration
        in its own time, and a client that counts live brokers right after `start` (topic creation
        with "auto" replication) must see all of them."""
        for node in self.nodes:
            for other in self.nodes:
                while True:
                    try:
                        run_sync(node.lists_node(other.node_id, max(deadline - time.monotonic(), 0.5)))
                        break
                    except Exception as e:
                        if time.monotonic() >= deadline:
                            raise KafkaSetupError(
                                f"node {node.node_id} does not list node {other.node_id} ({e!r})"
                            ) from e
                        time.sleep(0.1)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Clean shutdown of every node at once (one by one, the last ones would lose their quorum)."""
        with ThreadPoolExecutor(max_workers=self.size) as pool:
            list(pool.map(lambda node: node.stop(timeout_s), self.nodes))

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()

    def freeze(self, node_id: int) -> None:
        """SIGSTOP a node: it stays in memory, silent, as in a long GC pause or a network partition."""
        self._signal(node_id, signal.SIGSTOP)

    def thaw(self, node_id: int) -> None:
        """SIGCONT a frozen node: it comes back believing it still holds what it held."""
        self._signal(node_id, signal.SIGCONT)

    def _signal(self, node_id: int, signum: int) -> None:
        pid = self.node(node_id).pid
        if pid is None:
            raise KafkaSetupError(f"node {node_id} is not running")
        os.kill(pid, signum)
