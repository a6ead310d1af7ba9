//! The desired-state store: sandboxes and API keys, through sqlx's `Any` driver so the same
//! SQL runs on SQLite (embedded default: `data_dir/space.db`, WAL, synchronous=NORMAL) and
//! PostgreSQL. Placeholders are `$N` (both accept them); timestamps are unix milliseconds.

use std::collections::BTreeMap;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use space_api::SandboxState;
use sqlx::any::{AnyConnectOptions, AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, Connection, Row};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("failed to open database {url}")]
    Open {
        url: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("failed to migrate the database schema")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    #[error("query {what} failed")]
    Query {
        what: &'static str,
        #[source]
        source: sqlx::Error,
    },
    #[error("row {id} is corrupt: {reason}")]
    Corrupt { id: String, reason: String },
}

impl StoreError {
    /// Whether the database did not answer (down, restarting, unreachable, out of
    /// connections) rather than refused the query: the same request may succeed in a moment.
    pub fn is_unavailable(&self) -> bool {
        let source = match self {
            StoreError::Open { source, .. } | StoreError::Query { source, .. } => source,
            StoreError::Migrate(_) | StoreError::Corrupt { .. } => return false,
        };
        match source {
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => true,
            // Class 08: connection exception; 57P01-03: the server is shutting down or
            // starting (PostgreSQL's codes).
            sqlx::Error::Database(db) => db
                .code()
                .is_some_and(|c| c.starts_with("08") || matches!(&*c, "57P01" | "57P02" | "57P03")),
            _ => false,
        }
    }
}

type Result<T, E = StoreError> = std::result::Result<T, E>;

/// What a user asked for, normalized (defaults applied). Stored as JSON text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxSpecRecord {
    pub template: String,
    pub cpu: f64,
    pub memory_mib: u64,
    pub pids: u32,
    /// Disk limit in MiB (decision 0043; rows from before have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mib: Option<u64>,
    /// Resource limits the create set (rows from before decision 0041 have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rlimits: Option<space_api::Rlimits>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    pub hostname: String,
    /// Egress policy (rows from before decision 0012 have none: open).
    #[serde(default)]
    pub network: NetworkRecord,
    /// Secrets the sandbox uses (never their values).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<SecretBindingRecord>,
    /// "namespace" or "microvm" as asked at create; None: the node's default (rows from
    /// before the microvm runtime have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
    /// Copies of its snapshots kept on other nodes (decision 0037; rows from before have 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub replicas: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A sandbox's egress policy as stored: the egress mode and the rules, as given (each was
/// checked by the node's parser when set).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkRecord {
    pub egress: space_api::Egress,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
}

/// One secret a sandbox uses: its env var `name` holds `placeholder`, which the egress proxy
/// replaces in `header` of HTTPS requests to `hosts` (both copied from the secret when the
/// sandbox was created). With `inject`, there is no env var and no placeholder: the proxy
/// sets `header` itself (`secret_headers`, decision 0027).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretBindingRecord {
    pub name: String,
    pub placeholder: String,
    pub hosts: Vec<String>,
    pub header: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub inject: bool,
    /// The tenant whose secret it is; none for `default` (decision 0048).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRow {
    pub id: String,
    /// The tenant it belongs to (decision 0040).
    pub tenant: String,
    pub spec: SandboxSpecRecord,
    pub state: SandboxState,
    pub error: Option<String>,
    pub generation: i64,
    /// Set once deletion was requested (the finalizer mark).
    pub deleted_at: Option<i64>,
    pub created_at: i64,
    pub updated_at: i64,
}

#[derive(Debug, Clone)]
pub struct Store {
    pool: AnyPool,
    /// SQLite (the embedded default), where a statement needs another form than
    /// PostgreSQL's (see `leases`).
    sqlite: bool,
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Creates the database file 0600 when missing, and makes it and its `-wal` and `-shm` 0600
/// when they exist (a store made by an older spaced was 0644).
fn private_db_files(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)?;
    for suffix in ["", "-wal", "-shm"] {
        let mut p = path.as_os_str().to_owned();
        p.push(suffix);
        match std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

fn q(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { what, source }
}

impl Store {
    /// The embedded default: SQLite at `path` (created if missing), readable by its owner
    /// only (SQLite gives its `-wal` and `-shm` files the database file's mode).
    pub async fn open_sqlite(path: &Path) -> Result<Self> {
        private_db_files(path).map_err(|e| StoreError::Open {
            url: path.display().to_string(),
            source: sqlx::Error::Io(e),
        })?;
        Self::open(&format!("sqlite://{}?mode=rwc", path.display())).await
    }

    /// Opens `url` (`sqlite://...` or `postgres://...`) and applies the migrations.
    pub async fn open(url: &str) -> Result<Self> {
        sqlx::any::install_default_drivers();
        let open_err = |source| StoreError::Open {
            url: redact(url),
            source,
        };
        let opts = AnyConnectOptions::from_str(url).map_err(open_err)?;
        let is_sqlite = url.starts_with("sqlite:");
        let pool = AnyPoolOptions::new()
            .max_connections(if is_sqlite { 4 } else { 16 })
            .min_connections(1)
            // A PostgreSQL that does not answer (restarting, cut off) fails a request within
            // 3 s (503 with Retry-After); SQLite's only wait is its own write lock.
            .acquire_timeout(Duration::from_secs(if is_sqlite { 10 } else { 3 }))
            .after_connect(|conn, _meta| {
                Box::pin(async move {
                    if conn.backend_name().eq_ignore_ascii_case("sqlite") {
                        for pragma in [
                            "PRAGMA journal_mode = WAL",
                            "PRAGMA synchronous = NORMAL",
                            "PRAGMA busy_timeout = 5000",
                        ] {
                            sqlx::query(pragma).execute(&mut *conn).await?;
                        }
                    }
                    Ok(())
                })
            })
            .connect_with(opts)
            .await
            .map_err(open_err)?;
        crate::migrations::migrator()
            .await
            .map_err(StoreError::Migrate)?
            .run(&pool)
            .await
            .map_err(StoreError::Migrate)?;
        Ok(Self {
            pool,
            sqlite: is_sqlite,
        })
    }

    /// The pool, for store methods kept in other modules (e.g. snapshots).
    pub(crate) fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Whether the store is SQLite (one process's embedded store) rather than PostgreSQL.
    pub(crate) fn is_sqlite(&self) -> bool {
        self.sqlite
    }

    /// Checks that the database answers.
    pub async fn ping(&self) -> Result<()> {
        let mut conn = self.pool.acquire().await.map_err(q("ping"))?;
        conn.ping().await.map_err(q("ping"))
    }

    pub async fn insert_sandbox(&self, row: &SandboxRow) -> Result<()> {
        insert_sandbox_with(&self.pool, row).await
    }

    pub async fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRow>> {
        let row = sqlx::query(
            "SELECT id, spec, state, error, generation, deleted_at, created_at, updated_at, tenant_id \
             FROM sandboxes WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .map_err(q("get sandbox"))?;
        row.map(|r| decode_sandbox(&r)).transpose()
    }

    /// All sandboxes, oldest first.
    pub async fn list_sandboxes(&self) -> Result<Vec<SandboxRow>> {
        let rows = sqlx::query(
            "SELECT id, spec, state, error, generation, deleted_at, created_at, updated_at, tenant_id \
             FROM sandboxes ORDER BY created_at, id",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(q("list sandboxes"))?;
        rows.iter().map(decode_sandbox).collect()
    }

    /// Writes a sandbox's state and error. Entering `deleting` also sets the deletion mark
    /// (kept once set) and bumps the generation. Returns false if the row is gone.
    pub async fn set_status(
        &self,
        id: &str,
        state: SandboxState,
        error: Option<&str>,
    ) -> Result<bool> {
        let now = now_ms();
        let res = if state == SandboxState::Deleting {
            sqlx::query(
                "UPDATE sandboxes SET state = $1, error = $2, updated_at = $3, \
                 deleted_at = COALESCE(deleted_at, $3), generation = generation + 1 WHERE id = $4",
            )
            .bind(state.as_str())
            .bind(error.map(str::to_string))
            .bind(now)
            .bind(id)
            .execute(&self.pool)
            .await
        } else {
            sqlx::query(
                "UPDATE sandboxes SET state = $1, error = $2, updated_at = $3 WHERE id = $4",
            )
            .bind(state.as_str())
            .bind(error.map(str::to_string))
            .bind(now)
            .bind(id)
            .execute(&self.pool)
            .await
        }
        .map_err(q("set sandbox status"))?;
        Ok(res.rows_affected() > 0)
    }

    /// Replaces a sandbox's spec (e.g. a new egress policy). Returns false if the row is gone.
    pub async fn set_spec(&self, id: &str, spec: &SandboxSpecRecord) -> Result<bool> {
        let text = serde_json::to_string(spec).map_err(|e| StoreError::Corrupt {
            id: id.to_string(),
            reason: e.to_string(),
        })?;
        let res = sqlx::query("UPDATE sandboxes SET spec = $1, updated_at = $2 WHERE id = $3")
            .bind(text)
            .bind(now_ms())
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(q("set sandbox spec"))?;
        Ok(res.rows_affected() > 0)
    }

    /// Forgets a sandbox (the end of the deletion finalizer). Idempotent.
    pub async fn delete_sandbox(&self, id: &str) -> Result<()> {
        sqlx::query("DELETE FROM sandboxes WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(q("delete sandbox"))?;
        Ok(())
    }

    /// Number of sandboxes per state.
    pub async fn count_by_state(&self) -> Result<Vec<(String, i64)>> {
        let rows = sqlx::query("SELECT state, COUNT(*) AS n FROM sandboxes GROUP BY state")
            .fetch_all(&self.pool)
            .await
            .map_err(q("count sandboxes"))?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get::<String, _>("state")
                        .map_err(q("count sandboxes"))?,
                    r.try_get::<i64, _>("n").map_err(q("count sandboxes"))?,
                ))
            })
            .collect()
    }

    pub async fn insert_api_key(&self, id: &str, hash_hex: &str, name: &str) -> Result<()> {
        sqlx::query("INSERT INTO api_keys (id, hash, name, created_at) VALUES ($1, $2, $3, $4)")
            .bind(id)
            .bind(hash_hex)
            .bind(name)
            .bind(now_ms())
            .execute(&self.pool)
            .await
            .map_err(q("insert api key"))?;
        Ok(())
    }

    /// Removes every key with this name (used when the admin key is rotated).
    pub async fn delete_api_keys_named(&self, name: &str) -> Result<()> {
        sqlx::query("DELETE FROM api_keys WHERE name = $1")
            .bind(name)
            .execute(&self.pool)
            .await
            .map_err(q("delete api keys"))?;
        Ok(())
    }

    /// Hex sha256 hashes of the live API keys (not revoked, not expired).
    pub async fn api_key_hashes(&self) -> Result<Vec<String>> {
        let rows = sqlx::query(
            "SELECT hash FROM api_keys WHERE revoked_at IS NULL \
             AND (expires_at IS NULL OR expires_at > $1)",
        )
        .bind(now_ms())
        .fetch_all(&self.pool)
        .await
        .map_err(q("list api keys"))?;
        rows.iter()
            .map(|r| r.try_get::<String, _>("hash").map_err(q("list api keys")))
            .collect()
    }
}

/// Inserts a sandbox's row through `executor` (the pool, or a transaction).
pub(crate) async fn insert_sandbox_with<'e, E>(executor: E, row: &SandboxRow) -> Result<()>
where
    E: sqlx::Executor<'e, Database = sqlx::Any>,
{
    let spec = serde_json::to_string(&row.spec).map_err(|e| StoreError::Corrupt {
        id: row.id.clone(),
        reason: e.to_string(),
    })?;
    sqlx::query(
        "INSERT INTO sandboxes (id, spec, state, error, generation, deleted_at, created_at, \
         updated_at, tenant_id) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(&row.id)
    .bind(spec)
    .bind(row.state.as_str())
    .bind(row.error.clone())
    .bind(row.generation)
    .bind(row.deleted_at)
    .bind(row.created_at)
    .bind(row.updated_at)
    .bind(&row.tenant)
    .execute(executor)
    .await
    .map_err(q("insert sandbox"))?;
    Ok(())
}

fn decode_sandbox(r: &AnyRow) -> Result<SandboxRow> {
    let get = q("decode sandbox");
    let id: String = r.try_get("id").map_err(get)?;
    let corrupt = |reason: String| StoreError::Corrupt {
        id: id.clone(),
        reason,
    };
    let spec: String = r.try_get("spec").map_err(q("decode sandbox"))?;
    let spec: SandboxSpecRecord =
        serde_json::from_str(&spec).map_err(|e| corrupt(format!("bad spec: {e}")))?;
    let state: String = r.try_get("state").map_err(q("decode sandbox"))?;
    let state =
        SandboxState::parse(&state).ok_or_else(|| corrupt(format!("bad state {state:?}")))?;
    Ok(SandboxRow {
        spec,
        state,
        error: r.try_get("error").map_err(q("decode sandbox"))?,
        generation: r.try_get("generation").map_err(q("decode sandbox"))?,
        deleted_at: r.try_get("deleted_at").map_err(q("decode sandbox"))?,
        created_at: r.try_get("created_at").map_err(q("decode sandbox"))?,
        updated_at: r.try_get("updated_at").map_err(q("decode sandbox"))?,
        tenant: r.try_get("tenant_id").map_err(q("decode sandbox"))?,
        id,
    })
}

/// Hides a password in a database URL.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://***{}", &url[..scheme], &url[at..])
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn spec() -> SandboxSpecRecord {
        SandboxSpecRecord {
            template: "base".into(),
            cpu: 1.0,
            memory_mib: 512,
            pids: 512,
            disk_mib: None,
            rlimits: None,
            env: BTreeMap::from([("A".to_string(), "1".to_string())]),
            metadata: BTreeMap::new(),
            hostname: "h".into(),
            network: NetworkRecord::default(),
            secrets: Vec::new(),
            runtime: None,
            replicas: 0,
        }
    }

    pub(crate) fn row(id: &str, state: SandboxState, created_at: i64) -> SandboxRow {
        SandboxRow {
            id: id.into(),
            tenant: "default".into(),
            spec: spec(),
            state,
            error: None,
            generation: 1,
            deleted_at: None,
            created_at,
            updated_at: created_at,
        }
    }

    #[tokio::test]
    async fn sandboxes_roundtrip() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("space.db"))
            .await
            .unwrap();
        store.ping().await.unwrap();
        assert!(store.get_sandbox("nope").await.unwrap().is_none());
        let b = row("bbbbbbbbbbbbbbbbbbbb", SandboxState::Creating, 20);
        let a = row("aaaaaaaaaaaaaaaaaaaa", SandboxState::Running, 10);
        store.insert_sandbox(&b).await.unwrap();
        store.insert_sandbox(&a).await.unwrap();
        // Duplicate ids are refused.
        assert!(store.insert_sandbox(&a).await.is_err());
        assert_eq!(store.get_sandbox(&b.id).await.unwrap().unwrap(), b);
        let all = store.list_sandboxes().await.unwrap();
        assert_eq!(
            all.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
            [a.id.as_str(), b.id.as_str()]
        );

        assert!(
            store
                .set_status(&b.id, SandboxState::Failed, Some("boom"))
                .await
                .unwrap()
        );
        let got = store.get_sandbox(&b.id).await.unwrap().unwrap();
        assert_eq!(got.state, SandboxState::Failed);
        assert_eq!(got.error.as_deref(), Some("boom"));
        assert_eq!(got.deleted_at, None);

        assert!(
            store
                .set_status(&b.id, SandboxState::Deleting, None)
                .await
                .unwrap()
        );
        let got = store.get_sandbox(&b.id).await.unwrap().unwrap();
        assert_eq!(got.state, SandboxState::Deleting);
        assert_eq!(got.error, None);
        assert!(got.deleted_at.is_some());
        assert_eq!(got.generation, 2);

        let mut counts = store.count_by_state().await.unwrap();
        counts.sort();
        assert_eq!(
            counts,
            vec![("deleting".to_string(), 1), ("running".to_string(), 1)]
        );

        store.delete_sandbox(&b.id).await.unwrap();
        store.delete_sandbox(&b.id).await.unwrap();
        assert!(store.get_sandbox(&b.id).await.unwrap().is_none());
        assert!(
            !store
                .set_status(&b.id, SandboxState::Running, None)
                .await
                .unwrap()
        );
    }

    #[tokio::test]
    async fn reopen_keeps_data_and_uses_wal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("space.db");
        {
            let store = Store::open_sqlite(&path).await.unwrap();
            store
                .insert_sandbox(&row("cccccccccccccccccccc", SandboxState::Running, 1))
                .await
                .unwrap();
            store.insert_api_key("k1", "abc", "admin").await.unwrap();
            let mode: String = sqlx::query("PRAGMA journal_mode")
                .fetch_one(&store.pool)
                .await
                .unwrap()
                .try_get(0)
                .unwrap();
            assert_eq!(mode.to_ascii_lowercase(), "wal");
        }
        let store = Store::open_sqlite(&path).await.unwrap();
        assert_eq!(store.list_sandboxes().await.unwrap().len(), 1);
        assert_eq!(
            store.api_key_hashes().await.unwrap(),
            vec!["abc".to_string()]
        );
        store.delete_api_keys_named("admin").await.unwrap();
        assert!(store.api_key_hashes().await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn specs_keep_network_and_secrets_and_old_rows_default_to_open() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("space.db"))
            .await
            .unwrap();
        let mut r = row("dddddddddddddddddddd", SandboxState::Running, 1);
        store.insert_sandbox(&r).await.unwrap();
        r.spec.network = NetworkRecord {
            egress: space_api::Egress::Allowlist,
            allow: vec!["*.x.com".into(), "10.0.0.0/8".into()],
        };
        r.spec.secrets = vec![SecretBindingRecord {
            name: "K".into(),
            placeholder: "spc_ph_00".into(),
            hosts: vec!["api.x.com".into()],
            header: "Authorization: Bearer {}".into(),
            inject: false,
            tenant: Some("acme".into()),
        }];
        assert!(store.set_spec(&r.id, &r.spec).await.unwrap());
        assert_eq!(
            store.get_sandbox(&r.id).await.unwrap().unwrap().spec,
            r.spec
        );
        assert!(!store.set_spec("nope", &r.spec).await.unwrap());
        // A spec written before networking existed reads as open, no secrets.
        let old = r#"{"template":"base","cpu":1.0,"memory_mib":512,"pids":512,"hostname":"h"}"#;
        sqlx::query("UPDATE sandboxes SET spec = $1 WHERE id = $2")
            .bind(old)
            .bind(&r.id)
            .execute(&store.pool)
            .await
            .unwrap();
        let got = store.get_sandbox(&r.id).await.unwrap().unwrap().spec;
        assert_eq!(got.network, NetworkRecord::default());
        assert_eq!(got.network.egress, space_api::Egress::Open);
        assert!(got.secrets.is_empty());
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(redact("postgres://u:pw@host/db"), "postgres://***@host/db");
        assert_eq!(redact("sqlite:///x.db"), "sqlite:///x.db");
    }
}
