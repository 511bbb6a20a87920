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
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

KAFKA_VERSION = "3.9.1"
POM = Path(__file__).resolve().parent / "broker" / "pom.xml"
COMPLETE_MARKER = ".complete"
CLUSTER_FILE = "cluster.json"
LOG_FILE = "broker.log"
JVM_OPTIONS = (
    "-Xms128m",
    "-Xmx512m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:-UsePerfData",
    "-Xshare:auto",
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
    is tried first (offline), Maven Central second.
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
        if libs.exists():
            shutil.rmtree(libs)
        try:
            staging.rename(libs)
        except OSError:
            if not _jars_complete(libs):
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return libs


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
