"""A real single-node Apache Kafka broker (KRaft) for tests, the demo and `batchtide local`.

The broker is Apache Kafka's own jars from Maven Central, run on the Java 17
found on PATH. Why not a fake: the pipeline relies on consumer groups,
committed offsets, ListOffsets and transactions behaving exactly as in
production, and only the real broker guarantees that.

The first start on a data directory formats the KRaft storage, picks a free
loopback port and writes both into the directory, so a restart on the same
directory comes back on the same address with its topics, messages and
committed offsets; clients simply reconnect.

Kafka's jars and the Java command: `kafka_jars.py`; the node's configuration
files: `broker_config.py`; ports, pids and the lifeline: `broker_process.py`.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import json
import os
import signal
import subprocess
import tempfile
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

from pipeline.tools.devtools.broker_config import (
    FIRST_RECORDED_VERSION,
    ensure_tls_material,
    kafka_uuid,
    log4j2_properties,
    log4j_properties,
    security_protocol,
    server_properties,
    tls_dir,
    write_identity,
)
from pipeline.tools.devtools.broker_process import (
    LIFELINE,
    free_port,
    is_our_broker,
    log_tail,
    metadata_probe,
    pid_alive,
    port_is_free,
    restart_in_background,
    run_sync,
    wait_exit,
)
from pipeline.tools.devtools.kafka_jars import (
    DEFAULT_KAFKA_VERSION,
    KafkaSetupError,
    cds_archive,
    class_sharing_flags,
    ensure_kafka_jars,
    java_command,
    kafka_version,
    settle_archive,
    supports_share_groups,
)

__all__ = [
    "CLUSTER_FILE",
    "DEFAULT_KAFKA_VERSION",
    "KafkaSetupError",
    "LocalKafka",
    "cds_archive",
    "ensure_class_archive",
    "ensure_kafka_jars",
    "free_port",
    "kafka_uuid",
    "kafka_version",
    "port_is_free",
]

CLUSTER_FILE = "cluster.json"
LOG_FILE = "broker.log"
HEAP_MB = 512
"""Heap of a single broker; a cluster's nodes get less each (see localcluster.NODE_HEAP_MB)."""


def ensure_class_archive() -> Path | None:
    """Record the broker's class-data-sharing archive once (a throwaway broker started and stopped).

    Costs one broker start plus the archive dump (~10-20 s) on the first call,
    and saves ~40% of every later broker start. Returns None when disabled.
    The archive belongs to the jars of `kafka_version()`.
    """
    archive = cds_archive(kafka_version())
    if archive.is_file():
        return archive
    if os.environ.get("BATCHTIDE_KAFKA_CDS", "1") == "0":
        return None
    ensure_kafka_jars(kafka_version())
    with tempfile.TemporaryDirectory(prefix="kafka-cds-") as scratch:
        broker = LocalKafka(Path(scratch))
        broker._archive_dump = archive.with_name(f"{archive.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
        broker.start(timeout_s=180)
        broker.stop()
    return archive if archive.is_file() else None


_owned_brokers: weakref.WeakSet[LocalKafka] = weakref.WeakSet()


@atexit.register
def _stop_owned_brokers() -> None:
    """Brokers started by this process (and not detached) end with it."""
    for broker in list(_owned_brokers):
        if broker._process is not None and broker._process.poll() is None:
            broker.stop(timeout_s=10.0)


class LocalKafka:
    """One single-node KRaft broker (broker + controller in one JVM) on loopback.

    `sasl_users` turns on SASL (PLAIN and SCRAM-SHA-256) for those users; `tls`
    puts the client listener behind TLS with a certificate for 127.0.0.1 signed
    by a CA generated in the data dir (`ca_file`). The client listener's
    protocol is `security_protocol`; the controller listener stays PLAINTEXT
    on loopback.

    It runs Apache Kafka `kafka_version()` (BATCHTIDE_KAFKA_VERSION, read when
    the broker is made); a data dir keeps the newest version that ran it, and
    an older one refuses to start on it (Kafka's metadata only moves forward).
    """

    def __init__(
        self,
        data_dir: Path | str,
        port: int | None = None,
        sasl_users: dict[str, str] | None = None,
        tls: bool = False,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self._requested_port = port
        self.sasl_users = dict(sasl_users or {})
        self.tls = tls
        self.kafka_version = kafka_version()
        """The Apache Kafka release this broker runs."""
        self._process: subprocess.Popen[bytes] | None = None
        self._lifeline: int | None = None
        """Write end of the pipe whose closing stops the broker (see LIFELINE)."""
        self._cluster: dict[str, Any] | None = None
        self._archive_dump: Path | None = None
        self.last_start_s: float | None = None
        self._launched_at: float | None = None
        """Seconds the last start() took until the broker answered a metadata request."""

    def __repr__(self) -> str:
        state = "running" if self.is_running else "stopped"
        return f"LocalKafka({str(self.data_dir)!r}, bootstrap={self._bootstrap_or_none()!r}, {state})"

    # -- identity persisted in the data dir ---------------------------------

    @property
    def _cluster_file(self) -> Path:
        return self.data_dir / CLUSTER_FILE

    @property
    def _pid_file(self) -> Path:
        return self.data_dir / "broker.pid"

    @property
    def log_file(self) -> Path:
        """The broker's log4j output (the console stays quiet)."""
        return self.data_dir / LOG_FILE

    def _load_cluster(self) -> dict[str, Any] | None:
        if self._cluster is None and self._cluster_file.is_file():
            self._cluster = json.loads(self._cluster_file.read_text())
        return self._cluster

    def _prepare_cluster(self) -> dict[str, Any]:
        self._cluster = write_identity(
            self.data_dir,
            self._cluster_file,
            self._load_cluster(),
            self._requested_port,
            self.sasl_users,
            self.tls,
            self.kafka_version,
        )
        return self._cluster

    @property
    def recorded_version(self) -> str | None:
        """The Kafka release that last started this data dir (the running one, while it runs)."""
        cluster = self._load_cluster()
        return None if cluster is None else str(cluster.get("kafka_version", FIRST_RECORDED_VERSION))

    @property
    def port(self) -> int:
        cluster = self._load_cluster()
        if cluster is None:
            raise KafkaSetupError(f"the broker in {self.data_dir} has never been started")
        return int(cluster["port"])

    @property
    def bootstrap(self) -> str:
        """`127.0.0.1:PORT`, stable across restarts on the same data dir."""
        return f"127.0.0.1:{self.port}"

    def _bootstrap_or_none(self) -> str | None:
        return self.bootstrap if self._load_cluster() else None

    # -- configuration files -------------------------------------------------

    @property
    def node_id(self) -> int:
        """KRaft node id: 1 for a single broker, the node's number in a cluster (localcluster.py)."""
        cluster = self._load_cluster()
        return int(cluster.get("node_id", 1)) if cluster else 1

    @property
    def security_protocol(self) -> str:
        """Protocol of the client listener: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL."""
        return security_protocol(self.sasl_users, self.tls)

    @property
    def ca_file(self) -> Path | None:
        """PEM of the CA that signed the broker's certificate (clients' ssl_cafile), when `tls`."""
        return tls_dir(self.data_dir) / "ca.pem" if self.tls else None

    def _write_config(self, cluster: dict[str, Any]) -> Path:
        config = self.data_dir / "server.properties"
        config.write_text(
            server_properties(
                cluster,
                node_id=self.node_id,
                data_dir=self.data_dir,
                sasl_users=self.sasl_users,
                tls=self.tls,
                version=self.kafka_version,
            )
        )
        config.chmod(0o600)
        (self.data_dir / "log4j.properties").write_text(log4j_properties(self.log_file))
        (self.data_dir / "log4j2.properties").write_text(log4j2_properties())
        return config

    def _java_command(self, main_class: str, *args: str, class_sharing: list[str] | None = None) -> list[str]:
        return java_command(
            main_class,
            *args,
            version=self.kafka_version,
            heap_mb=self._heap_mb(),
            data_dir=self.data_dir,
            class_sharing=class_sharing or [],
        )

    def _heap_mb(self) -> int:
        cluster = self._load_cluster()
        return int(cluster.get("heap_mb", HEAP_MB)) if cluster else HEAP_MB

    def _format_storage(self, cluster: dict[str, Any], config: Path) -> None:
        """Format the KRaft log dir once; SCRAM credentials and feature levels can only be seeded here.

        From 4.2 the metadata gets share groups (`share.version=1`, KIP-932),
        named rather than left to the release's defaults.
        """
        if (self.data_dir / "logs" / "meta.properties").is_file():
            return
        args = ["format", "-t", str(cluster["cluster_id"]), "-c", str(config), "--ignore-formatted"]
        if supports_share_groups(self.kafka_version):
            args += ["--feature", "share.version=1"]
        for user, password in sorted(self.sasl_users.items()):
            args += ["--add-scram", f"SCRAM-SHA-256=[name={user},password={password}]"]
        result = subprocess.run(
            self._java_command(
                "kafka.tools.StorageTool", *args, class_sharing=[] if self._archive_dump else self._class_sharing()
            ),
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise KafkaSetupError(f"formatting {self.data_dir} failed:\n{result.stdout}{result.stderr}")

    # -- lifecycle -----------------------------------------------------------

    def _recorded_pid(self) -> int | None:
        try:
            pid = int(self._pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) and is_our_broker(pid, self.data_dir) else None

    @property
    def pid(self) -> int | None:
        if self._process is not None and self._process.poll() is None:
            return self._process.pid
        return self._recorded_pid()

    @property
    def is_running(self) -> bool:
        return self.pid is not None

    def start(self, timeout_s: float = 60.0, *, detached: bool = False) -> None:
        """Start the broker and return once it answers a Kafka metadata request.

        `detached` leaves the broker running when this Python process exits
        (used by `batchtide local up`); otherwise the JVM gets SIGTERM when the
        starting process dies, even by SIGKILL, so test and bench runs leave no
        stray brokers behind (see LIFELINE).
        """
        if self.is_running:
            return
        started = time.monotonic()
        self.launch(detached=detached)
        self.wait_ready(timeout_s, started=started)

    def launch(self, *, detached: bool = False) -> None:
        """Start the JVM and return at once; `wait_ready` waits for it to answer.

        A cluster launches all its nodes before waiting for any: a node's
        controller cannot elect a leader, so the node cannot become ready, until
        a majority of the quorum runs.
        """
        if self.is_running:
            return
        cluster = self._prepare_cluster()
        port = int(cluster["port"])
        if not port_is_free(port):
            raise KafkaSetupError(f"port {port} on 127.0.0.1 is taken; the broker in {self.data_dir} cannot start")
        if self.tls:
            ensure_tls_material(self.data_dir)
        config = self._write_config(cluster)
        self._format_storage(cluster, config)
        command = self._java_command("kafka.Kafka", str(config), class_sharing=self._class_sharing())
        stdin: int = subprocess.DEVNULL
        self._release()
        if not detached:
            stdin, self._lifeline = os.pipe()
            command = ["sh", "-c", LIFELINE, "sh", *command]
        try:
            with open(self.data_dir / "broker.out", "ab") as console:
                self._process = subprocess.Popen(
                    command,
                    stdin=stdin,
                    stdout=console,
                    stderr=subprocess.STDOUT,
                    cwd=self.data_dir,
                    start_new_session=True,
                )
        finally:
            if stdin != subprocess.DEVNULL:
                os.close(stdin)
        self._pid_file.write_text(f"{self._process.pid}\n")
        if not detached:
            _owned_brokers.add(self)
        self._launched_at = time.monotonic()

    def wait_ready(self, timeout_s: float = 60.0, *, started: float | None = None) -> None:
        """Return once the launched broker answers metadata listing itself; kill it on failure."""
        started = started if started is not None else self._launched_at or time.monotonic()
        try:
            self._wait_ready(started + timeout_s)
        except BaseException:
            self.kill()
            raise
        self.last_start_s = time.monotonic() - started

    def _wait_ready(self, deadline: float) -> None:
        error: Exception | None = None
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise KafkaSetupError(
                    f"the broker exited with code {self._process.returncode}; see {self.log_file}\n" + self._log_tail()
                )
            if not port_is_free(self.port):
                try:
                    run_sync(self.lists_node(self.node_id, deadline - time.monotonic()))
                    return
                except Exception as e:
                    error = e
            time.sleep(0.1)
        raise KafkaSetupError(f"the broker did not become ready in time ({error!r}); see {self.log_file}")

    async def lists_node(self, node_id: int, budget_s: float) -> None:
        """Succeeds once this broker's metadata lists node `node_id` as alive (itself: it is ready)."""
        await metadata_probe(
            self.bootstrap, node_id, budget_s,
            security=self.security_protocol, ca_file=self.ca_file, sasl_users=self.sasl_users,
        )  # fmt: skip

    def _log_tail(self, lines: int = 30) -> str:
        return log_tail([self.data_dir / "broker.out", self.log_file], lines)

    def _class_sharing(self) -> list[str]:
        return class_sharing_flags(self._archive_dump, self.kafka_version)

    def _settle_archive(self, clean_exit: bool) -> None:
        dump, self._archive_dump = self._archive_dump, None
        settle_archive(dump, clean_exit, self.kafka_version)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Clean shutdown (SIGTERM, then wait): the next start needs no log recovery."""
        pid = self.pid
        if pid is None:
            self._process = None
            return
        if self._archive_dump is not None:
            timeout_s += 120.0
        os.kill(pid, signal.SIGTERM)
        clean = self._wait_exit(pid, timeout_s)
        if not clean:
            os.kill(pid, signal.SIGKILL)
            self._wait_exit(pid, 10.0)
        self._release()
        self._settle_archive(clean)

    def kill(self) -> None:
        """SIGKILL the broker, as a crash would; the next start recovers its logs."""
        pid = self.pid
        if pid is None:
            self._process = None
            return
        os.kill(pid, signal.SIGKILL)
        self._wait_exit(pid, 10.0)
        self._release()
        self._settle_archive(clean_exit=False)

    def _release(self) -> None:
        """Forget the stopped process; closing the lifeline ends its watcher."""
        self._process = None
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None

    def _wait_exit(self, pid: int, timeout_s: float) -> bool:
        return wait_exit(pid, self._process, timeout_s)

    def restart_after(self, seconds: float, *, hard: bool = False) -> concurrent.futures.Future[float]:
        """Take the broker down now and bring it back on the same data dir after `seconds`.

        Returns once the broker is down; the restart runs in a background
        thread so the caller keeps producing and consuming through the outage.
        The future resolves to the measured downtime in seconds (stop until the
        broker answers again), or raises if the restart failed. `hard` kills
        with SIGKILL instead of a clean SIGTERM shutdown.
        """
        return restart_in_background(
            self.kill if hard else self.stop, self.start, seconds, f"kafka-restart-{self.port}"
        )
