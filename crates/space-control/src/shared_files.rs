//! The files every control-plane replica shares, kept in the store (issue 14, decision 0054):
//! `admin.key` (the admin key's plaintext, for the CLI on that host), `ports.key` (signs port
//! URLs) and the cluster CA (`cluster-ca/ca.key`, `cluster-ca/ca.pem`: node certificates and
//! each replica's identity). Each is sealed under `secrets.key` with its name as associated
//! data, so a copy of the database alone opens none of them, and `secrets.key` is the one
//! file an operator copies to start another replica.
//!
//! At start, under the `startup/shared-files` lease (so two replicas starting at once do not
//! each make their own):
//! 1. [`pull`]: each file the store holds is written into the data dir when missing there; one
//!    that differs is refused (a replica of another control plane, or a stale copy), never
//!    overwritten. `admin.key` is the exception: the store's list of live keys says which of
//!    two differing ones is current, and a stale one is replaced by, or replaces, the other.
//! 2. The control plane makes what is still missing, as it always has; a revoked admin key on
//!    disk is replaced by a new one (`auth::ensure_admin_key`), and [`refresh`] stores it.
//! 3. [`push`]: each file the store lacks is sealed into it.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use sqlx::Row;

use crate::secrets::SecretCipher;
use crate::store::{Store, StoreError, now_ms};

/// The shared files, relative to the data dir, with the mode each is written with.
pub const SHARED: [(&str, u32); 4] = [
    (crate::auth::ADMIN_KEY_FILE, 0o600),
    (crate::secrets::PORTS_KEY_FILE, 0o600),
    // `cluster::CA_DIR`'s files.
    ("cluster-ca/ca.key", 0o600),
    ("cluster-ca/ca.pem", 0o644),
];

/// The lease a replica holds while it pulls, makes and pushes them.
const LEASE: &str = "startup/shared-files";
/// How long a start waits for another replica's start to let go of [`LEASE`] (it lapses
/// [`crate::leases::LEASE_TTL`] after a holder that died).
const LEASE_WAIT: Duration = Duration::from_secs(45);

#[derive(Debug, thiserror::Error)]
pub enum SharedFileError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(
        "{path} differs from the {name} the other control-plane replicas share (kept in the \
         database): this data dir belongs to another control plane, or holds a stale copy. Move \
         it away to take the shared one (decision 0054)"
    )]
    Differs { path: PathBuf, name: &'static str },
    #[error(
        "secrets.key in {dir} does not open the files the control-plane replicas share in the \
         database: every replica needs the first replica's secrets.key (copy it into the data \
         dir before the first start; decision 0054)"
    )]
    WrongKey { dir: PathBuf },
    #[error("failed to {what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("another replica has been starting for {0:?}: its lease on the shared files is held")]
    Busy(Duration),
    #[error("sealing a shared file failed")]
    Seal,
}

fn q(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { what, source }
}

/// The associated data a shared file is sealed with: its name, apart from secrets' names.
fn aad(name: &str) -> String {
    format!("shared-file/{name}")
}

impl Store {
    /// Shared file `name` as stored: (nonce, ciphertext).
    async fn shared_file(&self, name: &str) -> Result<Option<(Vec<u8>, Vec<u8>)>, StoreError> {
        let row = sqlx::query("SELECT nonce, ciphertext FROM shared_files WHERE name = $1")
            .bind(name)
            .fetch_optional(self.pool())
            .await
            .map_err(q("get shared file"))?;
        let Some(row) = row else { return Ok(None) };
        let field = |col: &str| -> Result<Vec<u8>, StoreError> {
            let text: String = row.try_get(col).map_err(q("read shared file"))?;
            B64.decode(text).map_err(|e| StoreError::Corrupt {
                id: format!("shared file {name}"),
                reason: e.to_string(),
            })
        };
        Ok(Some((field("nonce")?, field("ciphertext")?)))
    }

    /// Stores shared file `name` unless one is stored already (false then); with `replace`,
    /// in its place.
    async fn put_shared_file(
        &self,
        name: &str,
        nonce: &[u8],
        sealed: &[u8],
        replace: bool,
    ) -> Result<bool, StoreError> {
        let on_conflict = if replace {
            "DO UPDATE SET nonce = excluded.nonce, ciphertext = excluded.ciphertext"
        } else {
            "DO NOTHING"
        };
        let done = sqlx::query(&format!(
            "INSERT INTO shared_files (name, nonce, ciphertext, created_at) \
             VALUES ($1, $2, $3, $4) ON CONFLICT (name) {on_conflict}"
        ))
        .bind(name)
        .bind(B64.encode(nonce))
        .bind(B64.encode(sealed))
        .bind(now_ms())
        .execute(self.pool())
        .await
        .map_err(q("put shared file"))?;
        Ok(done.rows_affected() == 1)
    }
}

fn read_optional(path: &Path) -> Result<Option<Vec<u8>>, SharedFileError> {
    match std::fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(SharedFileError::Io {
            what: "read",
            path: path.to_owned(),
            source,
        }),
    }
}

/// Writes `bytes` at `path` whole (a temporary file, synced, renamed), its directory 0700.
fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), SharedFileError> {
    let io = |what| {
        move |source| SharedFileError::Io {
            what,
            path: path.to_owned(),
            source,
        }
    };
    if let Some(dir) = path.parent()
        && !dir.exists()
    {
        crate::dir_with_mode(dir, 0o700).map_err(io("create the directory of"))?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io("create"))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .and_then(|()| std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode)))
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io("write")(e)
        })
}

/// Holds the start lease for as long as it lives.
pub struct StartLease {
    store: Store,
    holder: String,
}

impl StartLease {
    /// Takes [`LEASE`], waiting up to [`LEASE_WAIT`] for another replica's start.
    pub async fn take(store: &Store, holder: &str) -> Result<Self, SharedFileError> {
        let t0 = std::time::Instant::now();
        while !store
            .try_lease(LEASE, holder, crate::leases::LEASE_TTL)
            .await?
        {
            if t0.elapsed() > LEASE_WAIT {
                return Err(SharedFileError::Busy(LEASE_WAIT));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(Self {
            store: store.clone(),
            holder: holder.to_owned(),
        })
    }

    /// Lets go of it (it lapses anyway if this replica dies first).
    pub async fn release(self) -> Result<(), StoreError> {
        self.store.release_lease(LEASE, &self.holder).await
    }
}

/// Writes each shared file the store holds into `data_dir` where it is missing; refuses one
/// that differs. Returns the names written.
pub async fn pull(
    store: &Store,
    cipher: &SecretCipher,
    data_dir: &Path,
) -> Result<Vec<&'static str>, SharedFileError> {
    let mut written = Vec::new();
    for (name, mode) in SHARED {
        let Some((nonce, sealed)) = store.shared_file(name).await? else {
            continue;
        };
        let plain =
            cipher
                .open(&aad(name), &nonce, &sealed)
                .ok_or_else(|| SharedFileError::WrongKey {
                    dir: data_dir.to_owned(),
                })?;
        let path = data_dir.join(name);
        let take = match read_optional(&path)? {
            Some(local) if local == plain => false,
            // Another replica made a new admin key (this one's was revoked): take it. A
            // stored one that is not live either is left to `ensure_admin_key`.
            Some(_) if name == crate::auth::ADMIN_KEY_FILE => {
                admin_key_is_live(store, &plain).await?
            }
            Some(_) => return Err(SharedFileError::Differs { path, name }),
            None => true,
        };
        if take {
            write_new(&path, &plain, mode)?;
            written.push(name);
        }
    }
    Ok(written)
}

/// Whether `key` (an admin key file's bytes) is a live API key.
async fn admin_key_is_live(store: &Store, key: &[u8]) -> Result<bool, StoreError> {
    let key = String::from_utf8_lossy(key);
    let hash = crate::auth::to_hex(&crate::auth::hash_key(key.trim()));
    Ok(store.api_key_hashes().await?.contains(&hash))
}

/// Stores shared file `name` of `data_dir` in place of the stored one when they differ (the
/// admin key made at this start, which replaced a revoked one). True when it stored it.
pub async fn refresh(
    store: &Store,
    cipher: &SecretCipher,
    data_dir: &Path,
    name: &'static str,
) -> Result<bool, SharedFileError> {
    let Some(local) = read_optional(&data_dir.join(name))? else {
        return Ok(false);
    };
    if let Some((nonce, sealed)) = store.shared_file(name).await?
        && cipher.open(&aad(name), &nonce, &sealed).as_deref() == Some(local.as_slice())
    {
        return Ok(false);
    }
    seal_into(store, cipher, name, &local, true).await
}

/// Seals `bytes` as shared file `name` into the store: in place of a stored one with
/// `replace`, else only where none is (false then).
async fn seal_into(
    store: &Store,
    cipher: &SecretCipher,
    name: &str,
    bytes: &[u8],
    replace: bool,
) -> Result<bool, SharedFileError> {
    let (nonce, sealed) = cipher
        .seal(&aad(name), bytes)
        .map_err(|_| SharedFileError::Seal)?;
    Ok(store
        .put_shared_file(name, &nonce, &sealed, replace)
        .await?)
}

/// Seals each shared file of `data_dir` that the store lacks into it. Returns the names
/// stored.
pub async fn push(
    store: &Store,
    cipher: &SecretCipher,
    data_dir: &Path,
) -> Result<Vec<&'static str>, SharedFileError> {
    let mut stored = Vec::new();
    for (name, _) in SHARED {
        let Some(local) = read_optional(&data_dir.join(name))? else {
            continue;
        };
        if store.shared_file(name).await?.is_none()
            && seal_into(store, cipher, name, &local, false).await?
        {
            stored.push(name);
        }
    }
    Ok(stored)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cipher(byte: u8) -> SecretCipher {
        SecretCipher::new(&[byte; crate::secrets::KEY_LEN])
    }

    #[tokio::test]
    async fn a_second_replica_takes_the_first_ones_files_and_refuses_others() {
        let db = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&db.path().join("s.db")).await.unwrap();
        let (first, second) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        // The first replica: nothing stored yet; it made its files and pushes them.
        assert!(
            pull(&store, &cipher(1), first.path())
                .await
                .unwrap()
                .is_empty()
        );
        std::fs::write(first.path().join("ports.key"), [7u8; 32]).unwrap();
        std::fs::create_dir(first.path().join("cluster-ca")).unwrap();
        std::fs::write(first.path().join("cluster-ca/ca.pem"), "CERT").unwrap();
        let stored = push(&store, &cipher(1), first.path()).await.unwrap();
        assert_eq!(stored, ["ports.key", "cluster-ca/ca.pem"]);
        // Pushed once: a second push stores nothing, and nothing the store holds is replaced.
        std::fs::write(first.path().join("ports.key"), [8u8; 32]).unwrap();
        assert!(
            push(&store, &cipher(1), first.path())
                .await
                .unwrap()
                .is_empty()
        );
        std::fs::write(first.path().join("ports.key"), [7u8; 32]).unwrap();

        // The second replica, an empty data dir with the same secrets.key: it gets them.
        let got = pull(&store, &cipher(1), second.path()).await.unwrap();
        assert_eq!(got, ["ports.key", "cluster-ca/ca.pem"]);
        assert_eq!(
            std::fs::read(second.path().join("ports.key")).unwrap(),
            [7u8; 32]
        );
        let mode = |p: &str| {
            std::fs::metadata(second.path().join(p))
                .unwrap()
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(
            (
                mode("ports.key"),
                mode("cluster-ca"),
                mode("cluster-ca/ca.pem")
            ),
            (0o600, 0o700, 0o644)
        );
        // Pulled again: nothing to write, nothing refused.
        assert!(
            pull(&store, &cipher(1), second.path())
                .await
                .unwrap()
                .is_empty()
        );

        // Another secrets.key opens none of them.
        let third = tempfile::tempdir().unwrap();
        let e = pull(&store, &cipher(2), third.path()).await.unwrap_err();
        assert!(matches!(e, SharedFileError::WrongKey { .. }), "{e}");
        assert!(e.to_string().contains("secrets.key"), "{e}");
        assert!(!third.path().join("ports.key").exists());

        // A data dir holding another ports.key is refused, and its file is left as it was.
        std::fs::write(third.path().join("ports.key"), [9u8; 32]).unwrap();
        let e = pull(&store, &cipher(1), third.path()).await.unwrap_err();
        assert!(
            matches!(
                &e,
                SharedFileError::Differs {
                    name: "ports.key",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("Move it away"), "{e}");
        assert_eq!(
            std::fs::read(third.path().join("ports.key")).unwrap(),
            [9u8; 32]
        );
    }

    #[tokio::test]
    async fn one_start_at_a_time_holds_the_lease() {
        let db = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&db.path().join("s.db")).await.unwrap();
        let a = StartLease::take(&store, "a").await.unwrap();
        assert!(
            !store
                .try_lease(LEASE, "b", crate::leases::LEASE_TTL)
                .await
                .unwrap()
        );
        a.release().await.unwrap();
        let b = StartLease::take(&store, "b").await.unwrap();
        b.release().await.unwrap();
    }
}
