"""Versioned, idempotent schema migrations from schemas/clickhouse/NNNN_name.sql.

Each file is a template rendered for one of two layouts:

* single node: plain MergeTree-family engines, no ON CLUSTER, no Distributed;
* cluster NAME: every statement ON CLUSTER, Replicated* engines on
  `<table>_local`, and a Distributed table under the plain name over them,
  so analysis SQL (which names `request_latency`, `batches`, ...) runs
  unchanged on both.

Placeholders: `${db}`, `${on_cluster}`, `${local}`, `${ttl_days}`,
`${rollup_ttl_days}`, `${engine:Family}` and `${distributed:table:sharding_key}`
(a whole statement, empty on a single node). Files are applied in version
order; each applied file is recorded with its checksum in `schema_migrations`,
so a second run is a no-op and an edited, already-applied file is reported.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from clickhouse_connect.driver.client import Client

from pipeline.core.store.connection import scalar_int
from pipeline.core.store.identifiers import checked_identifier

SCHEMA_DIR = Path(__file__).resolve().parents[3] / "schemas" / "clickhouse"
FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
PLACEHOLDER = re.compile(r"\$\{(\w+)(?::([^:}]+))?(?::([^}]+))?\}")
REPLICA_PATH = "'/clickhouse/tables/{shard}/{database}/{table}', '{replica}'"


class MigrationError(RuntimeError):
    """A schema file is malformed, or an applied file was edited afterwards."""


@dataclass(frozen=True)
class Layout:
    """Where the schema goes: database, TTLs and (optionally) a cluster name."""

    database: str
    ttl_days: int = 30
    rollup_ttl_days: int = 400
    cluster: str | None = None

    def __post_init__(self) -> None:
        checked_identifier(self.database)
        if self.cluster is not None:
            checked_identifier(self.cluster, "cluster")
        if self.ttl_days < 1 or self.rollup_ttl_days < 1:
            raise ValueError("ttl_days and rollup_ttl_days must be >= 1")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    template: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.template.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class MigrationResult:
    applied: list[int]
    already: list[int]


def load_migrations(directory: Path = SCHEMA_DIR) -> list[Migration]:
    """All schema files in version order; versions must be unique."""
    found: dict[int, Migration] = {}
    for path in sorted(directory.glob("*.sql")):
        match = FILE_NAME.match(path.name)
        if not match:
            raise MigrationError(f"{path}: schema files are named NNNN_name.sql")
        version = int(match.group(1))
        if version in found:
            raise MigrationError(f"{path}: version {version} is used twice")
        found[version] = Migration(version, match.group(2), path.read_text())
    return [found[v] for v in sorted(found)]


def _render_placeholder(match: re.Match[str], layout: Layout) -> str:
    key, first, second = match.group(1), match.group(2), match.group(3)
    clustered = layout.cluster is not None
    if key == "db":
        return layout.database
    if key == "local":
        return "_local" if clustered else ""
    if key == "on_cluster":
        return f"ON CLUSTER '{layout.cluster}'" if clustered else ""
    if key == "ttl_days":
        return str(int(layout.ttl_days))
    if key == "rollup_ttl_days":
        return str(int(layout.rollup_ttl_days))
    if key == "engine" and first:
        return f"Replicated{first}({REPLICA_PATH})" if clustered else first
    if key == "distributed" and first and second:
        if not clustered:
            return ""
        db, cluster = layout.database, layout.cluster
        return (
            f"CREATE TABLE IF NOT EXISTS {db}.{first} ON CLUSTER '{cluster}' "
            f"AS {db}.{first}_local\n"
            f"ENGINE = Distributed('{cluster}', '{db}', '{first}_local', {second})"
        )
    raise MigrationError(f"unknown placeholder {match.group(0)}")


def render(migration: Migration, layout: Layout) -> list[str]:
    """The statements of one file for one layout, comments stripped, empty ones dropped."""
    text = "\n".join(line for line in migration.template.splitlines() if not line.lstrip().startswith("--"))
    text = PLACEHOLDER.sub(lambda m: _render_placeholder(m, layout), text)
    return [stmt.strip() for stmt in text.split(";") if stmt.strip()]


def render_all(layout: Layout, directory: Path = SCHEMA_DIR) -> str:
    """The whole schema as one SQL script (what `db migrate --print` shows)."""
    parts = []
    for migration in load_migrations(directory):
        parts.append(f"-- {migration.version:04d}_{migration.name}")
        parts.extend(f"{stmt};" for stmt in render(migration, layout))
    return "\n\n".join(parts) + "\n"


def applied_versions(client: Client, database: str) -> dict[int, str]:
    """version -> checksum of the files already applied (empty on a fresh database)."""
    exists = scalar_int(
        client,
        "SELECT count() FROM system.tables WHERE database = {db:String} AND name = 'schema_migrations'",
        {"db": database},
    )
    if not exists:
        return {}
    rows = client.query(
        f"SELECT version, argMax(checksum, applied_at) FROM {database}.schema_migrations GROUP BY version"
    ).result_rows
    return {int(version): str(checksum) for version, checksum in rows}


def migrate(client: Client, layout: Layout, directory: Path = SCHEMA_DIR) -> MigrationResult:
    """Apply every file not yet recorded, in order; safe to run any number of times."""
    migrations = load_migrations(directory)
    done = applied_versions(client, layout.database)
    applied: list[int] = []
    already: list[int] = []
    for migration in migrations:
        recorded = done.get(migration.version)
        if recorded is not None:
            if recorded != migration.checksum:
                raise MigrationError(
                    f"{migration.version:04d}_{migration.name}.sql changed after it was applied "
                    f"(checksum {recorded} -> {migration.checksum}); add a new migration instead"
                )
            already.append(migration.version)
            continue
        for statement in render(migration, layout):
            client.command(statement)
        client.insert(
            f"{layout.database}.schema_migrations",
            [[migration.version, migration.name, migration.checksum]],
            column_names=["version", "name", "checksum"],
        )
        applied.append(migration.version)
    return MigrationResult(applied=applied, already=already)
