"""Apache Kafka's own jars, fetched once from Maven Central, and the Java command that runs them.

The jars are the broker's whole installation: `ensure_kafka_jars` resolves
Kafka's runtime dependencies with Maven into ~/.cache/batchtide/kafka-<version>
once, and `java_command` runs one of their main classes on the Java 17 found
on PATH, with the JVM flags that keep a local broker small and quick to start
(and its class-data-sharing archive, `cds_archive`, when one was recorded).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

KAFKA_VERSION = "3.9.1"
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


def java_command(main_class: str, *args: str, heap_mb: int, data_dir: Path, class_sharing: list[str]) -> list[str]:
    """The command line that runs `main_class` of Kafka's jars with a broker's heap and log4j config."""
    java = shutil.which("java")
    if java is None:
        raise KafkaSetupError("java is not on PATH (Java 17 runs the local Kafka broker)")
    libs = ensure_kafka_jars()
    return [
        java,
        *JVM_OPTIONS,
        f"-Xmx{heap_mb}m",
        *class_sharing,
        f"-Dlog4j.configuration=file:{data_dir / 'log4j.properties'}",
        f"-Dkafka.logs.dir={data_dir}",
        "-cp",
        f"{libs}/*",
        main_class,
        *args,
    ]


def class_sharing_flags(dump: Path | None) -> list[str]:
    """JVM flags for the class-data-sharing archive that cuts broker start time by ~40%: record it
    into `dump`, or use the recorded one.

    `ensure_class_archive` (run by `batchtide local fetch`) records the
    archive once; without it the broker simply starts without sharing.
    BATCHTIDE_KAFKA_CDS=0 turns sharing off.
    """
    if dump is not None:
        return [f"-XX:ArchiveClassesAtExit={dump}"]
    archive = cds_archive()
    if os.environ.get("BATCHTIDE_KAFKA_CDS", "1") == "0" or not archive.is_file():
        return []
    return [f"-XX:SharedArchiveFile={archive}"]


def settle_archive(dump: Path | None, clean_exit: bool) -> None:
    """Keep an archive dumped at a clean exit as the archive; drop a partial one."""
    if dump is None:
        return
    if clean_exit and dump.is_file() and dump.stat().st_size > 0:
        os.replace(dump, cds_archive())
    else:
        dump.unlink(missing_ok=True)
