"""A local Kafka node's files: its identity (cluster.json), server.properties, log4j, its TLS material.

The identity (cluster id, ports, and for a cluster's node its quorum and the
replication its topics get) is made on the first start and kept in the data
dir; the configuration is text written from it, except the throwaway CA and
certificate that `ensure_tls_material` makes once with openssl.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

from pipeline.tools.devtools.broker_process import free_port
from pipeline.tools.devtools.kafka_jars import KafkaSetupError, parse_version, supports_share_groups

FIRST_RECORDED_VERSION = "3.9.1"
"""The version a cluster.json without `kafka_version` was made by: the only one batchtide ran before."""


def kafka_uuid() -> str:
    """A cluster id in Kafka's own format: URL-safe base64 of 16 random bytes."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def jaas_escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def write_identity(
    data_dir: Path,
    path: Path,
    known: dict[str, Any] | None,
    port: int | None,
    sasl_users: dict[str, str],
    tls: bool,
    version: str,
) -> dict[str, Any]:
    """The node's identity (cluster id, ports, security, Kafka version), made on its first start and kept
    in `path` (cluster.json) so a restart comes back on the same address; a requested port moves it.

    `kafka_version` is the newest release that ran the node: a newer one upgrades it (Kafka reads
    an older line's KRaft metadata), an older one is refused (it cannot read a newer one's)."""
    cluster = known
    if cluster is None:
        port = port or free_port()
        controller_port = free_port()
        while controller_port == port:
            controller_port = free_port()
        cluster = {
            "cluster_id": kafka_uuid(),
            "port": port,
            "controller_port": controller_port,
            "sasl": bool(sasl_users),
            "tls": tls,
            "internal_password": uuid.uuid4().hex,
            "kafka_version": version,
        }
    elif port and cluster["port"] != port:
        cluster = {**cluster, "port": port}
    recorded = str(cluster.get("kafka_version", FIRST_RECORDED_VERSION))
    if parse_version(version) < parse_version(recorded):
        raise KafkaSetupError(
            f"{data_dir} was run by Apache Kafka {recorded}, which {version} cannot read; "
            f"use another data dir, or BATCHTIDE_KAFKA_VERSION={recorded}"
        )
    cluster = {**cluster, "kafka_version": version}
    if bool(cluster["sasl"]) != bool(sasl_users) or bool(cluster.get("tls")) != tls:
        raise KafkaSetupError(
            f"{data_dir} was set up with sasl={cluster['sasl']} tls={cluster.get('tls', False)}; "
            "use another data dir to change that"
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cluster, indent=2))
    tmp.chmod(0o600)
    tmp.replace(path)
    return cluster


def security_protocol(sasl_users: dict[str, str], tls: bool) -> str:
    """Protocol of the client listener: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL."""
    return ("SASL_" if sasl_users else "") + ("SSL" if tls else "PLAINTEXT")


def tls_dir(data_dir: Path) -> Path:
    return data_dir / "tls"


def server_properties(
    cluster: dict[str, Any], *, node_id: int, data_dir: Path, sasl_users: dict[str, str], tls: bool, version: str
) -> str:
    """server.properties of one KRaft node (broker and controller in one JVM) of Kafka `version` from its
    cluster.json."""
    port, cport = cluster["port"], cluster["controller_port"]
    # A cluster node's cluster.json (written by LocalCluster) names its quorum and the
    # replication its internal topics get; a single broker replicates nothing.
    replicas = int(cluster.get("replicas", 1))
    min_isr = int(cluster.get("min_insync_replicas", 1))
    props: dict[str, Any] = {
        "process.roles": "broker,controller",
        "node.id": node_id,
        "controller.quorum.voters": cluster.get("voters", f"1@127.0.0.1:{cport}"),
        "controller.listener.names": "CONTROLLER",
        "log.dirs": data_dir / "logs",
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
    if supports_share_groups(version):
        # Share groups (KIP-932): the share protocol added to Kafka's default protocols (the
        # setting is deprecated by 4.4 in favour of feature levels, which `_format_storage`
        # sets too), and the share coordinator's state topic sized and replicated like the
        # transaction log (its defaults, 50 partitions and 3 replicas, would not come up on one broker).
        props |= {
            "group.coordinator.rebalance.protocols": "classic,consumer,streams,share",
            "share.coordinator.state.topic.replication.factor": replicas,
            "share.coordinator.state.topic.min.isr": min_isr,
            "share.coordinator.state.topic.num.partitions": 4,
        }
    if replicas > 1:
        # A follower that stops fetching (frozen, partitioned) leaves the ISR after 10 s
        # rather than 30 s, so acks=all writes stall for less; a fenced broker leaves at once.
        props["replica.lag.time.max.ms"] = 10000
    name = security_protocol(sasl_users, tls)
    props |= {
        "listeners": f"{name}://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
        "advertised.listeners": f"{name}://127.0.0.1:{port}",
        "listener.security.protocol.map": f"{name}:{name},CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": name,
    }
    if sasl_users:
        internal = ("batchtide-broker", str(cluster["internal_password"]))
        users = {**sasl_users, internal[0]: internal[1]}
        plain_users = " ".join(f'user_{u}="{jaas_escape(p)}"' for u, p in sorted(users.items()))
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
    if tls:
        props |= {
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": tls_dir(data_dir) / "broker-keystore.pem",
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": tls_dir(data_dir) / "ca.pem",
            "ssl.client.auth": "none",
        }
    return "".join(f"{key}={value}\n" for key, value in props.items())


def ensure_tls_material(data_dir: Path) -> None:
    """A throwaway CA and a broker certificate for 127.0.0.1/localhost, made once per data dir."""
    directory = tls_dir(data_dir)
    keystore = directory / "broker-keystore.pem"
    if keystore.is_file():
        return
    if shutil.which("openssl") is None:
        raise KafkaSetupError("openssl is not on PATH; it makes the TLS broker's certificates")
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    d = directory
    steps = [
        [
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "3650",
            "-subj",
            "/CN=batchtide local CA",
            "-keyout",
            d / "ca.key",
            "-out",
            d / "ca.pem",
        ],
        [
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            d / "broker.key",
            "-out",
            d / "broker.csr",
        ],
        [
            "x509",
            "-req",
            "-days",
            "3650",
            "-in",
            d / "broker.csr",
            "-CA",
            d / "ca.pem",
            "-CAkey",
            d / "ca.key",
            "-CAcreateserial",
            "-out",
            d / "broker.pem",
            "-extfile",
            d / "san.cnf",
        ],
    ]
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for step in steps:
        result = subprocess.run(["openssl", *map(str, step)], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise KafkaSetupError(f"openssl {step[0]} failed: {result.stderr[-2000:]}")
    pem = "".join((d / name).read_text() for name in ("broker.key", "broker.pem", "ca.pem"))
    keystore.write_text(pem)
    keystore.chmod(0o600)


def log4j2_properties() -> str:
    """log4j2 settings for Kafka 4's broker, which loads log4j2 for its log-level controller while its
    log goes through SLF4J to reload4j (`log4j_properties`): no appender of its own, so it neither
    writes nor complains on the console that it found no configuration."""
    return "status = warn\nname = batchtide-broker\nrootLogger.level = info\n"


def log4j_properties(log: Path) -> str:
    """log4j settings: everything to `log` (rolled at 20 MB), the console quiet."""
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
