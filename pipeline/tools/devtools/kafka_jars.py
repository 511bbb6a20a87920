"""Apache Kafka's own jars, fetched once from Maven Central, and the Java command that runs them.

The jars are the broker's whole installation: `ensure_kafka_jars` resolves
Kafka's runtime dependencies with Maven into ~/.cache/batchtide/kafka-<version>
once, and `java_command` runs one of their main classes on the Java 17 found
on PATH, with the JVM flags that keep a local broker small and quick to start
(and its class-data-sharing archive, `cds_archive`, when one was recorded).

The version is `DEFAULT_KAFKA_VERSION` unless BATCHTIDE_KAFKA_VERSION names
another (3.9.x is the oldest batchtide supports), so the same tests, demo and
chaos runs can be pointed at an older broker; each version has its own cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

DEFAULT_KAFKA_VERSION = "4.4.0"
"""The broker `batchtide local`, the tests, the demo and chaos run unless told otherwise."""
OLDEST_KAFKA_VERSION = (3, 9)
"""The oldest broker line batchtide supports (transactions, KIP-447 fencing and KRaft all need less;
this is the oldest line the suite is run on)."""
SHARE_GROUPS_FROM = (4, 2)
"""Share groups (KIP-932) are production-ready from Kafka 4.2; the local broker enables them there."""
POM = Path(__file__).resolve().parent / "broker" / "pom.xml"
COMPLETE_MARKER = ".complete"
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


def parse_version(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of an Apache Kafka release name such as "4.2.0"."""
    parts = text.strip().split(".")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        raise KafkaSetupError(f"{text!r} is not an Apache Kafka release (major.minor.patch, e.g. 3.9.1)")
    major, minor, patch = (int(part) for part in parts)
    return major, minor, patch


def kafka_version() -> str:
    """The broker version to run: env BATCHTIDE_KAFKA_VERSION, else `DEFAULT_KAFKA_VERSION`.

    Read at each call, so a test session or a command started with the
    variable set runs that broker throughout.
    """
    version = os.environ.get("BATCHTIDE_KAFKA_VERSION", "").strip() or DEFAULT_KAFKA_VERSION
    if parse_version(version)[:2] < OLDEST_KAFKA_VERSION:
        oldest = ".".join(map(str, OLDEST_KAFKA_VERSION))
        raise KafkaSetupError(f"Apache Kafka {version} is older than {oldest}, the oldest broker batchtide supports")
    return version


def supports_share_groups(version: str) -> bool:
    """Whether the local broker of `version` runs share groups (KIP-932): 4.2 or newer."""
    return parse_version(version)[:2] >= SHARE_GROUPS_FROM


def kafka_home(version: str | None = None) -> Path:
    """Where a version's jars live: ~/.cache/batchtide/kafka-<version> (env BATCHTIDE_KAFKA_HOME overrides)."""
    override = os.environ.get("BATCHTIDE_KAFKA_HOME")
    if override:
        return Path(override)
    return Path.home() / ".cache" / "batchtide" / f"kafka-{version or kafka_version()}"


def _jars_complete(libs: Path, version: str) -> bool:
    marker = libs / COMPLETE_MARKER
    if not marker.is_file():
        return False
    names = marker.read_text().split()
    return f"kafka_2.13-{version}.jar" in names and all((libs / name).is_file() for name in names)


def _copy_dependencies(output: Path, version: str, offline: bool) -> subprocess.CompletedProcess[str]:
    command = ["mvn", "-q", "-B"]
    if offline:
        command.append("-o")
    command += [
        "dependency:copy-dependencies",
        f"-Dkafka.version={version}",
        f"-DoutputDirectory={output}",
        "-DincludeScope=runtime",
        "-f",
        str(POM),
    ]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def ensure_kafka_jars(version: str | None = None) -> Path:
    """Resolve the runtime jars of Kafka `version` (default: `kafka_version()`) once; return their directory.

    Idempotent: a complete directory is reused as is. Jars are copied into a
    temporary sibling and renamed into place, so an interrupted fetch never
    leaves a half-filled directory that looks complete. The local Maven cache
    is tried first (offline), Maven Central second. New jars invalidate the
    class-data-sharing archive recorded from the old ones.
    """
    version = version or kafka_version()
    libs = kafka_home(version) / "libs"
    if _jars_complete(libs, version):
        return libs
    if shutil.which("mvn") is None:
        raise KafkaSetupError("Maven (mvn) is not on PATH; it is needed once to fetch Kafka's jars")
    if not POM.is_file():
        raise KafkaSetupError(f"{POM} is missing; run from a source checkout")
    libs.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="libs-", dir=libs.parent))
    try:
        result = _copy_dependencies(staging, version, offline=True)
        if result.returncode != 0:
            result = _copy_dependencies(staging, version, offline=False)
        if result.returncode != 0:
            raise KafkaSetupError(
                f"could not resolve Kafka {version}'s jars from Maven Central:\n"
                + (result.stdout + result.stderr)[-3000:]
            )
        jars = sorted(p.name for p in staging.glob("*.jar"))
        if f"kafka_2.13-{version}.jar" not in jars:
            raise KafkaSetupError(f"Maven produced no kafka_2.13-{version}.jar in {staging}")
        (staging / COMPLETE_MARKER).write_text("\n".join(jars) + "\n")
        if _jars_complete(libs, version):
            return libs
        if libs.exists():
            shutil.rmtree(libs)
        try:
            staging.rename(libs)
        except OSError:
            if not _jars_complete(libs, version):
                raise
        cds_archive(version).unlink(missing_ok=True)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return libs


def cds_archive(version: str | None = None) -> Path:
    """The broker's class-data-sharing archive, next to the jars it was built from."""
    return kafka_home(version) / "broker.jsa"


def java_command(
    main_class: str, *args: str, version: str, heap_mb: int, data_dir: Path, class_sharing: list[str]
) -> list[str]:
    """The command line that runs `main_class` of Kafka `version`'s jars with a broker's heap and log4j config."""
    java = shutil.which("java")
    if java is None:
        raise KafkaSetupError("java is not on PATH (Java 17 runs the local Kafka broker)")
    libs = ensure_kafka_jars(version)
    return [
        java,
        *JVM_OPTIONS,
        f"-Xmx{heap_mb}m",
        *class_sharing,
        f"-Dlog4j.configuration=file:{data_dir / 'log4j.properties'}",
        f"-Dlog4j2.configurationFile={data_dir / 'log4j2.properties'}",
        f"-Dkafka.logs.dir={data_dir}",
        "-cp",
        f"{libs}/*",
        main_class,
        *args,
    ]


def class_sharing_flags(dump: Path | None, version: str) -> list[str]:
    """JVM flags for the class-data-sharing archive that cuts broker start time by ~40%: record it
    into `dump`, or use the recorded one.

    `ensure_class_archive` (run by `batchtide local fetch`) records the
    archive once; without it the broker simply starts without sharing.
    BATCHTIDE_KAFKA_CDS=0 turns sharing off.
    """
    if dump is not None:
        return [f"-XX:ArchiveClassesAtExit={dump}"]
    archive = cds_archive(version)
    if os.environ.get("BATCHTIDE_KAFKA_CDS", "1") == "0" or not archive.is_file():
        return []
    return [f"-XX:SharedArchiveFile={archive}"]


def settle_archive(dump: Path | None, clean_exit: bool, version: str) -> None:
    """Keep an archive dumped at a clean exit as `version`'s archive; drop a partial one."""
    if dump is None:
        return
    if clean_exit and dump.is_file() and dump.stat().st_size > 0:
        os.replace(dump, cds_archive(version))
    else:
        dump.unlink(missing_ok=True)
