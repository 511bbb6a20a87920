"""A real single-node Apache Kafka broker (KRaft) for tests, the demo and `batchtide local`.

The broker is Apache Kafka's own jars from Maven Central, run on the Java 17
found on PATH. Why not a fake: the pipeline relies on consumer groups,
committed offsets, ListOffsets and transactions behaving exactly as in
production, and only the real broker guarantees that.

The first start on a data directory formats the KRaft storage, picks a free
loopback port and writes both into the directory, so a restart on the same
directory comes back on the same address with its topics, messages and
committed offsets; clients simply reconnect.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

KAFKA_VERSION = "3.9.1"
POM = Path(__file__).resolve().parent / "broker" / "pom.xml"
COMPLETE_MARKER = ".complete"
CLUSTER_FILE = "cluster.json"
LOG_FILE = "broker.log"
HEAP_MB = 512
"""Heap of a single broker; a cluster's nodes get less each (see localcluster.NODE_HEAP_MB)."""
JVM_OPTIONS = (
    "-Xms128m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:-UsePerfData",
    "-Xshare:auto",
    "-Xlog:cds*=off",
    "-Djava.awt.headless=true",
)


class KafkaSetupError(RuntimeError):
    """The broker's jars or Java runtime are missing, or the broker failed to start."""


def kafka_home() -> Path:
    """Where the jars live: ~/.cache/batchtide/kafka-<version> (env BATCHTIDE_KAFKA_HOME overrides)."""
    override = os.environ.get("BATCHTIDE_KAFKA_HOME")
    if override:
        return Path(override)
    return Path.home() / ".cache" / "batchtide" / f"kafka-{KAFKA_VERSION}"


def _jars_complete(libs: Path) -> bool:
    marker = libs / COMPLETE_MARKER
    if not marker.is_file():
        return False
    names = marker.read_text().split()
    return bool(names) and all((libs / name).is_file() for name in names)


def _copy_dependencies(output: Path, offline: bool) -> subprocess.CompletedProcess[str]:
    command = ["mvn", "-q", "-B"]
    if offline:
        command.append("-o")
    command += [
        "dependency:copy-dependencies",
        f"-DoutputDirectory={output}",
        "-DincludeScope=runtime",
        "-f",
        str(POM),
    ]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def ensure_kafka_jars() -> Path:
    """Resolve Kafka's runtime jars once; return the directory holding them.

    Idempotent: a complete directory is reused as is. Jars are copied into a
    temporary sibling and renamed into place, so an interrupted fetch never
    leaves a half-filled directory that looks complete. The local Maven cache
    is tried first (offline), Maven Central second. New jars invalidate the
    class-data-sharing archive recorded from the old ones.
    """
    libs = kafka_home() / "libs"
    if _jars_complete(libs):
        return libs
    if shutil.which("mvn") is None:
        raise KafkaSetupError("Maven (mvn) is not on PATH; it is needed once to fetch Kafka's jars")
    if not POM.is_file():
        raise KafkaSetupError(f"{POM} is missing; run from a source checkout")
    libs.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="libs-", dir=libs.parent))
    try:
        result = _copy_dependencies(staging, offline=True)
        if result.returncode != 0:
            result = _copy_dependencies(staging, offline=False)
        if result.returncode != 0:
            raise KafkaSetupError(
                "could not resolve Kafka jars from Maven Central:\n" + (result.stdout + result.stderr)[-3000:]
            )
        jars = sorted(p.name for p in staging.glob("*.jar"))
        if not any(name.startswith(f"kafka_2.13-{KAFKA_VERSION}") for name in jars):
            raise KafkaSetupError(f"Maven produced no kafka_2.13-{KAFKA_VERSION} jar in {staging}")
        (staging / COMPLETE_MARKER).write_text("\n".join(jars) + "\n")
        if _jars_complete(libs):
            return libs
        if libs.exists():
            shutil.rmtree(libs)
        try:
            staging.rename(libs)
        except OSError:
            if not _jars_complete(libs):
                raise
        cds_archive().unlink(missing_ok=True)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return libs


def cds_archive() -> Path:
    """The broker's class-data-sharing archive, next to the jars it was built from."""
    return kafka_home() / "broker.jsa"


def ensure_class_archive() -> Path | None:
    """Record the broker's class-data-sharing archive once (a throwaway broker started and stopped).

    Costs one broker start plus the archive dump (~10-20 s) on the first call,
    and saves ~40% of every later broker start. Returns None when disabled.
    """
    archive = cds_archive()
    if archive.is_file():
        return archive
    if os.environ.get("BATCHTIDE_KAFKA_CDS", "1") == "0":
        return None
    ensure_kafka_jars()
    with tempfile.TemporaryDirectory(prefix="kafka-cds-") as scratch:
        broker = LocalKafka(Path(scratch))
        broker._archive_dump = archive.with_name(f"{archive.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
        broker.start(timeout_s=180)
        broker.stop()
    return archive if archive.is_file() else None


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int) -> bool:
    """Whether a server could listen on the loopback port now.

    SO_REUSEADDR as the JVM sets it: connections of a stopped broker lingering
    in TIME_WAIT must not block its restart on the same port.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _kafka_uuid() -> str:
    """A cluster id in Kafka's own format: URL-safe base64 of 16 random bytes."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def _jaas_escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _is_our_broker(pid: int, data_dir: Path) -> bool:
    """A recorded pid is only trusted while it still runs Kafka on this data dir."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return str(data_dir / "server.properties").encode() in cmdline


def _run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, even inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


LIFELINE = 'exec 3<&0; (cat <&3 >/dev/null; kill -TERM 0) & exec 3<&- "$@"'
"""Runs the broker with a watcher in its process group that reads the broker's
stdin, a pipe whose write end only the starting process holds. When that
process ends, however it ends (SIGKILL included, from any thread), the pipe
closes and the watcher sends SIGTERM to the group. `setpriv --pdeathsig`
would not do: it fires when the starting thread ends, and brokers are often
started from a worker thread (asyncio.to_thread)."""

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
        self._process: subprocess.Popen[bytes] | None = None
        self._lifeline: int | None = None
        """Write end of the pipe whose closing stops the broker (see LIFELINE)."""
        self._cluster: dict[str, object] | None = None
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

    def _load_cluster(self) -> dict[str, object] | None:
        if self._cluster is None and self._cluster_file.is_file():
            self._cluster = json.loads(self._cluster_file.read_text())
        return self._cluster

    def _prepare_cluster(self) -> dict[str, object]:
        cluster = self._load_cluster()
        if cluster is None:
            port = self._requested_port or free_port()
            controller_port = free_port()
            while controller_port == port:
                controller_port = free_port()
            cluster = {
                "cluster_id": _kafka_uuid(),
                "port": port,
                "controller_port": controller_port,
                "sasl": bool(self.sasl_users),
                "tls": self.tls,
                "internal_password": uuid.uuid4().hex,
            }
        elif self._requested_port and cluster["port"] != self._requested_port:
            cluster = {**cluster, "port": self._requested_port}
        if bool(cluster["sasl"]) != bool(self.sasl_users) or bool(cluster.get("tls")) != self.tls:
            raise KafkaSetupError(
                f"{self.data_dir} was set up with sasl={cluster['sasl']} tls={cluster.get('tls', False)}; "
                "use another data dir to change that"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        tmp = self._cluster_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(cluster, indent=2))
        tmp.chmod(0o600)
        tmp.replace(self._cluster_file)
        self._cluster = cluster
        return cluster

    @property
    def port(self) -> int:
        cluster = self._load_cluster()
        if cluster is None:
            raise KafkaSetupError(f"the broker in {self.data_dir} has never been started")
        return int(cluster["port"])  # type: ignore[arg-type]

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
        return int(cluster.get("node_id", 1)) if cluster else 1  # type: ignore[arg-type]

    def _server_properties(self, cluster: dict[str, object]) -> str:
        port, cport = cluster["port"], cluster["controller_port"]
        # A cluster node's cluster.json (written by LocalCluster) names its quorum and the
        # replication its internal topics get; a single broker replicates nothing.
        replicas = int(cluster.get("replicas", 1))  # type: ignore[arg-type]
        min_isr = int(cluster.get("min_insync_replicas", 1))  # type: ignore[arg-type]
        props: dict[str, object] = {
            "process.roles": "broker,controller",
            "node.id": self.node_id,
            "controller.quorum.voters": cluster.get("voters", f"1@127.0.0.1:{cport}"),
            "controller.listener.names": "CONTROLLER",
            "log.dirs": self.data_dir / "logs",
            "num.partitions": 4,
            "default.replication.factor": replicas,
            "min.insync.replicas": min_isr,
            "offsets.topic.replication.factor": replicas,
            "offsets.topic.num.partitions": 8,
            "transaction.state.log.replication.factor": replicas,
            "transaction.state.log.min.isr": min_isr,
            "transaction.state.log.num.partitions": 4,
            "group.initial.rebalance.delay.ms": 0,
            "auto.create.topics.enable": "false",
            "delete.topic.enable": "true",
            "num.network.threads": 2,
            "num.io.threads": 4,
            "num.recovery.threads.per.data.dir": 2,
            "background.threads": 2,
            "log.cleaner.threads": 1,
            "log.cleaner.dedupe.buffer.size": 8 * 1024 * 1024,
            "log.segment.bytes": 64 * 1024 * 1024,
            "log.retention.hours": 168,
            "group.min.session.timeout.ms": 500,
            # After a crash the controller refuses the broker's re-registration until
            # the old session expires (default 9 s); keep that wait short.
            "broker.heartbeat.interval.ms": 500,
            "broker.session.timeout.ms": 3000,
        }
        if replicas > 1:
            # A follower that stops fetching (frozen, partitioned) leaves the ISR after 10 s
            # rather than 30 s, so acks=all writes stall for less; a fenced broker leaves at once.
            props["replica.lag.time.max.ms"] = 10000
        name = self.security_protocol
        props |= {
            "listeners": f"{name}://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
            "advertised.listeners": f"{name}://127.0.0.1:{port}",
            "listener.security.protocol.map": f"{name}:{name},CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": name,
        }
        if self.sasl_users:
            internal = ("batchtide-broker", str(cluster["internal_password"]))
            users = {**self.sasl_users, internal[0]: internal[1]}
            plain_users = " ".join(f'user_{u}="{_jaas_escape(p)}"' for u, p in sorted(users.items()))
            listener = name.lower()
            props |= {
                "sasl.enabled.mechanisms": "PLAIN,SCRAM-SHA-256",
                "sasl.mechanism.inter.broker.protocol": "PLAIN",
                f"listener.name.{listener}.plain.sasl.jaas.config": (
                    "org.apache.kafka.common.security.plain.PlainLoginModule required "
                    f'username="{internal[0]}" password="{internal[1]}" {plain_users};'
                ),
                f"listener.name.{listener}.scram-sha-256.sasl.jaas.config": (
                    "org.apache.kafka.common.security.scram.ScramLoginModule required;"
                ),
            }
        if self.tls:
            props |= {
                "ssl.keystore.type": "PEM",
                "ssl.keystore.location": self._tls_dir / "broker-keystore.pem",
                "ssl.truststore.type": "PEM",
                "ssl.truststore.location": self._tls_dir / "ca.pem",
                "ssl.client.auth": "none",
            }
        return "".join(f"{key}={value}\n" for key, value in props.items())

    @property
    def security_protocol(self) -> str:
        """Protocol of the client listener: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL."""
        return ("SASL_" if self.sasl_users else "") + ("SSL" if self.tls else "PLAINTEXT")

    @property
    def _tls_dir(self) -> Path:
        return self.data_dir / "tls"

    @property
    def ca_file(self) -> Path | None:
        """PEM of the CA that signed the broker's certificate (clients' ssl_cafile), when `tls`."""
        return self._tls_dir / "ca.pem" if self.tls else None

    def _ensure_tls_material(self) -> None:
        """A throwaway CA and a broker certificate for 127.0.0.1/localhost, made once per data dir."""
        keystore = self._tls_dir / "broker-keystore.pem"
        if keystore.is_file():
            return
        if shutil.which("openssl") is None:
            raise KafkaSetupError("openssl is not on PATH; it makes the TLS broker's certificates")
        self._tls_dir.mkdir(parents=True, exist_ok=True)
        self._tls_dir.chmod(0o700)
        d = self._tls_dir
        steps = [
            ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650", "-subj", "/CN=batchtide local CA",
             "-keyout", d / "ca.key", "-out", d / "ca.pem"],
            ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
             "-keyout", d / "broker.key", "-out", d / "broker.csr"],
            ["x509", "-req", "-days", "3650", "-in", d / "broker.csr", "-CA", d / "ca.pem", "-CAkey", d / "ca.key",
             "-CAcreateserial", "-out", d / "broker.pem", "-extfile", d / "san.cnf"],
        ]
        (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        for step in steps:
            result = subprocess.run(["openssl", *map(str, step)], capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise KafkaSetupError(f"openssl {step[0]} failed: {result.stderr[-2000:]}")
        pem = "".join((d / name).read_text() for name in ("broker.key", "broker.pem", "ca.pem"))
        keystore.write_text(pem)
        keystore.chmod(0o600)

    def _log4j_properties(self) -> str:
        log = self.log_file
        return (
            "log4j.rootLogger=INFO, file\n"
            "log4j.appender.file=org.apache.log4j.RollingFileAppender\n"
            f"log4j.appender.file.File={log}\n"
            "log4j.appender.file.MaxFileSize=20MB\n"
            "log4j.appender.file.MaxBackupIndex=2\n"
            "log4j.appender.file.layout=org.apache.log4j.PatternLayout\n"
            "log4j.appender.file.layout.ConversionPattern=[%d] %p %m (%c)%n\n"
            "log4j.logger.kafka=INFO\n"
            "log4j.logger.org.apache.kafka=INFO\n"
            "log4j.logger.state.change.logger=WARN\n"
            "log4j.logger.kafka.request.logger=WARN\n"
        )

    def _write_config(self, cluster: dict[str, object]) -> Path:
        config = self.data_dir / "server.properties"
        config.write_text(self._server_properties(cluster))
        config.chmod(0o600)
        (self.data_dir / "log4j.properties").write_text(self._log4j_properties())
        return config

    def _java_command(self, main_class: str, *args: str, class_sharing: list[str] | None = None) -> list[str]:
        java = shutil.which("java")
        if java is None:
            raise KafkaSetupError("java is not on PATH (Java 17 runs the local Kafka broker)")
        libs = ensure_kafka_jars()
        return [
            java,
            *JVM_OPTIONS,
            f"-Xmx{self._heap_mb()}m",
            *(class_sharing or []),
            f"-Dlog4j.configuration=file:{self.data_dir / 'log4j.properties'}",
            f"-Dkafka.logs.dir={self.data_dir}",
            "-cp",
            f"{libs}/*",
            main_class,
            *args,
        ]

    def _heap_mb(self) -> int:
        cluster = self._load_cluster()
        return int(cluster.get("heap_mb", HEAP_MB)) if cluster else HEAP_MB  # type: ignore[arg-type]

    def _format_storage(self, cluster: dict[str, object], config: Path) -> None:
        """Format the KRaft log dir once; SCRAM credentials can only be seeded here."""
        if (self.data_dir / "logs" / "meta.properties").is_file():
            return
        args = ["format", "-t", str(cluster["cluster_id"]), "-c", str(config), "--ignore-formatted"]
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
        return pid if _pid_alive(pid) and _is_our_broker(pid, self.data_dir) else None

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
        port = int(cluster["port"])  # type: ignore[arg-type]
        if not port_is_free(port):
            raise KafkaSetupError(f"port {port} on 127.0.0.1 is taken; the broker in {self.data_dir} cannot start")
        if self.tls:
            self._ensure_tls_material()
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
                    f"the broker exited with code {self._process.returncode}; see {self.log_file}\n"
                    + self._log_tail()
                )
            if not port_is_free(self.port):
                try:
                    _run_sync(self._metadata_probe(deadline - time.monotonic()))
                    return
                except Exception as e:  # noqa: BLE001 - not ready yet; retried until the deadline
                    error = e
            time.sleep(0.1)
        raise KafkaSetupError(f"the broker did not become ready in time ({error!r}); see {self.log_file}")

    async def _metadata_probe(self, budget_s: float) -> None:
        """Succeeds once the broker answers metadata and lists itself as alive (unfenced)."""
        from aiokafka import AIOKafkaClient

        from pipeline.core.kafka.client import REDACTOR

        options: dict[str, object] = {
            "bootstrap_servers": self.bootstrap,
            "request_timeout_ms": 5000,
            "security_protocol": self.security_protocol,
        }
        if self.tls:
            from aiokafka.helpers import create_ssl_context

            options["ssl_context"] = create_ssl_context(cafile=self.ca_file)
        if self.sasl_users:
            user, password = next(iter(sorted(self.sasl_users.items())))
            REDACTOR.add(password)
            options |= {
                "sasl_mechanism": "PLAIN",
                "sasl_plain_username": user,
                "sasl_plain_password": password,
            }
        client = AIOKafkaClient(**options)  # type: ignore[arg-type]
        try:
            await asyncio.wait_for(client.bootstrap(), timeout=max(budget_s, 0.5))
            if client.cluster.broker_metadata(self.node_id) is None:
                raise KafkaSetupError(f"metadata does not list node {self.node_id} as a live broker yet")
        finally:
            await client.close()

    def _log_tail(self, lines: int = 30) -> str:
        for path in (self.data_dir / "broker.out", self.log_file):
            if path.is_file():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                if text:
                    return "\n".join(text)
        return ""

    def _class_sharing(self) -> list[str]:
        """JVM flags for the class-data-sharing archive that cuts broker start time by ~40%.

        `ensure_class_archive` (run by `batchtide local fetch`) records the
        archive once; without it the broker simply starts without sharing.
        BATCHTIDE_KAFKA_CDS=0 turns sharing off.
        """
        if self._archive_dump is not None:
            return [f"-XX:ArchiveClassesAtExit={self._archive_dump}"]
        archive = cds_archive()
        if os.environ.get("BATCHTIDE_KAFKA_CDS", "1") == "0" or not archive.is_file():
            return []
        return [f"-XX:SharedArchiveFile={archive}"]

    def _settle_archive(self, clean_exit: bool) -> None:
        dump, self._archive_dump = self._archive_dump, None
        if dump is None:
            return
        if clean_exit and dump.is_file() and dump.stat().st_size > 0:
            os.replace(dump, cds_archive())
        else:
            dump.unlink(missing_ok=True)

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
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.pid == pid:
                if self._process.poll() is not None:
                    return True
            elif not _pid_alive(pid):
                return True
            time.sleep(0.05)
        return False

    def restart_after(self, seconds: float, *, hard: bool = False) -> concurrent.futures.Future[float]:
        """Take the broker down now and bring it back on the same data dir after `seconds`.

        Returns once the broker is down; the restart runs in a background
        thread so the caller keeps producing and consuming through the outage.
        The future resolves to the measured downtime in seconds (stop until the
        broker answers again), or raises if the restart failed. `hard` kills
        with SIGKILL instead of a clean SIGTERM shutdown.
        """
        outage: concurrent.futures.Future[float] = concurrent.futures.Future()
        down_at = time.monotonic()
        if hard:
            self.kill()
        else:
            self.stop()

        def bring_back() -> None:
            try:
                time.sleep(max(seconds - (time.monotonic() - down_at), 0.0))
                self.start()
                outage.set_result(time.monotonic() - down_at)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                outage.set_exception(e)

        threading.Thread(target=bring_back, name=f"kafka-restart-{self.port}", daemon=True).start()
        return outage
