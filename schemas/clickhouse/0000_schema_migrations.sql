-- Which schema files have been applied, with a checksum of each file so an
-- edited, already-applied migration is caught instead of silently skipped.
CREATE DATABASE IF NOT EXISTS ${db} ${on_cluster};

CREATE TABLE IF NOT EXISTS ${db}.schema_migrations${local} ${on_cluster}
(
    version    UInt32,
    name       String,
    checksum   String,
    applied_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ${engine:ReplacingMergeTree}
ORDER BY version;

${distributed:schema_migrations:version};
