//! The schema migrations, embedded in the binary. `sqlx::migrate!` would embed them too, but it
//! needs sqlx's `macros` feature, whose proc macro builds a second copy of sqlx's drivers for
//! the host, SQLite's C library included: minutes of every clean build (decision 0020). Each
//! entry becomes what `migrate!` makes of its file (same version, description and SQL, so the
//! same checksum), so a database migrated by an earlier build opens unchanged.

use std::borrow::Cow;

use futures::future::BoxFuture;
use sqlx::error::BoxDynError;
use sqlx::migrate::{MigrateError, Migration, MigrationSource, MigrationType, Migrator};

/// `migrations/NNNN_description.sql`, in order. A new file must be listed here (a unit test
/// compares this list with the directory).
const FILES: &[(&str, &str)] = &[
    ("0001_init.sql", include_str!("../migrations/0001_init.sql")),
    (
        "0002_snapshots.sql",
        include_str!("../migrations/0002_snapshots.sql"),
    ),
    (
        "0003_pause_timeouts.sql",
        include_str!("../migrations/0003_pause_timeouts.sql"),
    ),
    (
        "0004_events.sql",
        include_str!("../migrations/0004_events.sql"),
    ),
    (
        "0005_snapshot_policy.sql",
        include_str!("../migrations/0005_snapshot_policy.sql"),
    ),
    (
        "0006_checkpoints.sql",
        include_str!("../migrations/0006_checkpoints.sql"),
    ),
    (
        "0007_network.sql",
        include_str!("../migrations/0007_network.sql"),
    ),
    (
        "0008_template_pools.sql",
        include_str!("../migrations/0008_template_pools.sql"),
    ),
    (
        "0009_template_settings.sql",
        include_str!("../migrations/0009_template_settings.sql"),
    ),
    (
        "0010_secret_versions.sql",
        include_str!("../migrations/0010_secret_versions.sql"),
    ),
    (
        "0011_cluster.sql",
        include_str!("../migrations/0011_cluster.sql"),
    ),
    (
        "0012_placement.sql",
        include_str!("../migrations/0012_placement.sql"),
    ),
    (
        "0013_drain.sql",
        include_str!("../migrations/0013_drain.sql"),
    ),
    (
        "0014_idempotency.sql",
        include_str!("../migrations/0014_idempotency.sql"),
    ),
    (
        "0015_leases.sql",
        include_str!("../migrations/0015_leases.sql"),
    ),
    (
        "0016_replicas.sql",
        include_str!("../migrations/0016_replicas.sql"),
    ),
    (
        "0017_tenants.sql",
        include_str!("../migrations/0017_tenants.sql"),
    ),
    (
        "0018_tenant_objects.sql",
        include_str!("../migrations/0018_tenant_objects.sql"),
    ),
    (
        "0019_tenant_disk.sql",
        include_str!("../migrations/0019_tenant_disk.sql"),
    ),
    (
        "0020_shared_files.sql",
        include_str!("../migrations/0020_shared_files.sql"),
    ),
];

/// The version and description `migrate!` derives from a file name (`0002_snapshots.sql` is
/// version 2, "snapshots"), or `None` for a name it would not take.
fn parse_name(file: &str) -> Option<(i64, String)> {
    let stem = file.strip_suffix(".sql")?;
    let (version, description) = stem.split_once('_')?;
    Some((version.parse().ok()?, description.replace('_', " ")))
}

fn migrations() -> Vec<Migration> {
    FILES
        .iter()
        .map(|(file, sql)| {
            let (version, description) =
                parse_name(file).expect("FILES holds NNNN_description.sql names");
            Migration::new(
                version,
                Cow::Owned(description),
                MigrationType::Simple,
                Cow::Borrowed(*sql),
                sql.starts_with("-- no-transaction"),
            )
        })
        .collect()
}

#[derive(Debug)]
struct Embedded;

impl<'s> MigrationSource<'s> for Embedded {
    fn resolve(self) -> BoxFuture<'s, Result<Vec<Migration>, BoxDynError>> {
        Box::pin(async { Ok(migrations()) })
    }
}

/// The migrator for the embedded migrations.
pub async fn migrator() -> Result<Migrator, MigrateError> {
    Migrator::new(Embedded).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_in_the_directory_is_embedded_in_order() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations");
        let mut on_disk: Vec<(String, String)> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "sql"))
            .map(|p| {
                let name = p.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read_to_string(&p).unwrap())
            })
            .collect();
        on_disk.sort();
        let embedded: Vec<(String, String)> = FILES
            .iter()
            .map(|(f, s)| (f.to_string(), s.to_string()))
            .collect();
        assert_eq!(embedded, on_disk);
        let versions: Vec<i64> = migrations().iter().map(|m| m.version).collect();
        assert_eq!(versions, (1..=FILES.len() as i64).collect::<Vec<_>>());
    }

    #[test]
    fn names_parse_as_migrate_does() {
        assert_eq!(
            parse_name("0002_snapshots.sql"),
            Some((2, "snapshots".into()))
        );
        assert_eq!(
            parse_name("0003_pause_timeouts.sql"),
            Some((3, "pause timeouts".into()))
        );
        assert_eq!(parse_name("init.sql"), None);
        assert_eq!(parse_name("0001_init.txt"), None);
    }
}
