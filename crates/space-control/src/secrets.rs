//! Secrets (decision 0012): values kept by the control plane, sealed at rest, handed to the
//! node's egress proxy only in memory at request time ([`SecretVault`] implements
//! [`SecretSource`]). A sandbox created with a secret gets an environment variable holding a
//! random placeholder; the API never returns a value, events and logs never carry one.
//!
//! - Sealing: CHACHA20-POLY1305 (ring) under `<data_dir>/secrets.key` (32 random bytes, 0600,
//!   made at first start). Each value has its own random 96-bit nonce; the secret's
//!   [`vault_key`] (its tenant and name) is the associated data, so a sealed value cannot be
//!   moved to another name or another tenant.
//! - A secret belongs to a tenant (decision 0048): every key, admin keys too, sees and binds
//!   the secrets of its own tenant only; the same name in two tenants is two secrets.
//! - Validation of names, hosts, headers and values is pure ([`validate_put`]).

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use ring::aead::{self, Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};
use space_api::tenant::DEFAULT_TENANT;
use space_api::{
    MAX_SECRET_BYTES, PutSecret, SecretHeader, SecretInfo, is_valid_env_key, is_valid_secret_name,
    rfc3339_from_unix_ms,
};
use space_node_api::net::SecretSource;
use sqlx::Row;
use sqlx::any::AnyRow;

use crate::engine::Engine;
use crate::error::{ControlError, ControlResult};
use crate::store::{SecretBindingRecord, Store, StoreError, now_ms};

/// Length of the key files (`secrets.key`, `ports.key`).
pub const KEY_LEN: usize = 32;
/// The key file that seals secrets and the files replicas share, in the data dir.
pub const SECRETS_KEY_FILE: &str = "secrets.key";
/// The key file that signs port URLs, in the data dir.
pub const PORTS_KEY_FILE: &str = "ports.key";
/// Prefix of placeholders; the rest is 32 lowercase hex digits.
pub const PLACEHOLDER_PREFIX: &str = "spc_ph_";

#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    #[error("failed to read key file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to create key file {path}")]
    Create {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "key file {path} holds {len} bytes, expected {KEY_LEN}; refusing to start (restore the \
         original file: a new key cannot open what the old one sealed)"
    )]
    Size { path: PathBuf, len: usize },
    #[error("the system random generator failed")]
    Random,
}

/// Reads a [`KEY_LEN`]-byte key file, creating it (random bytes, mode 0600) when missing.
/// A file of any other size is an error, never replaced.
pub fn load_or_create_key(path: &Path) -> Result<[u8; KEY_LEN], KeyFileError> {
    match std::fs::read(path) {
        Ok(bytes) => {
            return <[u8; KEY_LEN]>::try_from(bytes.as_slice()).map_err(|_| KeyFileError::Size {
                path: path.to_owned(),
                len: bytes.len(),
            });
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(KeyFileError::Read {
                path: path.to_owned(),
                source,
            });
        }
    }
    let mut key = [0u8; KEY_LEN];
    SystemRandom::new()
        .fill(&mut key)
        .map_err(|_| KeyFileError::Random)?;
    let create = |source| KeyFileError::Create {
        path: path.to_owned(),
        source,
    };
    // Written whole under a temporary name, then linked in place: a crash never leaves a
    // short key file, and a concurrent creator's key wins (link fails if it exists).
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(create)?;
    f.write_all(&key).and_then(|()| f.sync_all()).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        create(e)
    })?;
    drop(f);
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(key),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => load_or_create_key(path),
        Err(e) => Err(create(e)),
    }
}

/// Warns when a key file is readable by others than its owner.
pub fn warn_if_loose(path: &Path) {
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o077 != 0
    {
        tracing::warn!(path = %path.display(), mode = format!("{:o}", meta.permissions().mode() & 0o777), "key file is readable by group or others; chmod 600 it");
    }
}

/// Seals and opens secret values.
pub struct SecretCipher {
    key: LessSafeKey,
    rng: SystemRandom,
}

impl SecretCipher {
    pub fn new(key: &[u8; KEY_LEN]) -> Self {
        let unbound = UnboundKey::new(&CHACHA20_POLY1305, key).expect("32-byte chacha20 key");
        Self {
            key: LessSafeKey::new(unbound),
            rng: SystemRandom::new(),
        }
    }

    /// (nonce, ciphertext + tag) of `value`, bound to `name`.
    pub fn seal(&self, name: &str, value: &[u8]) -> ControlResult<([u8; 12], Vec<u8>)> {
        let mut nonce = [0u8; aead::NONCE_LEN];
        self.rng
            .fill(&mut nonce)
            .map_err(|_| ControlError::internal("the system random generator failed"))?;
        let mut buf = value.to_vec();
        self.key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(name.as_bytes()),
                &mut buf,
            )
            .map_err(|_| ControlError::internal("sealing a secret failed"))?;
        Ok((nonce, buf))
    }

    /// The value, or None when the ciphertext, nonce or name do not match the key.
    pub fn open(&self, name: &str, nonce: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut buf = sealed.to_vec();
        let plain = self
            .key
            .open_in_place(nonce, Aad::from(name.as_bytes()), &mut buf)
            .ok()?;
        Some(plain.to_vec())
    }
}

// ---------------------------------------------------------------- validation (pure)

pub fn check_name(name: &str) -> ControlResult<()> {
    if is_valid_secret_name(name) {
        Ok(())
    } else {
        Err(ControlError::invalid(format!(
            "invalid secret name {name:?}: expected [A-Za-z_][A-Za-z0-9_.-]{{0,63}}"
        )))
    }
}

/// `Name: template`: a token header name, a template holding `{}` exactly once, no control
/// characters (CR, LF, NUL...).
pub fn check_header(header: &str) -> ControlResult<()> {
    let bad = |why: &str| {
        Err(ControlError::invalid(format!(
            "invalid header {header:?}: {why}"
        )))
    };
    if header.bytes().any(|b| b.is_ascii_control() && b != b'\t') {
        return bad("control characters (CR, LF, NUL) are not allowed");
    }
    let Some((name, template)) = header.split_once(':') else {
        return bad("expected \"Name: template\", e.g. \"Authorization: Bearer {}\"");
    };
    const TCHAR: &[u8] = b"!#$%&'*+-.^_`|~";
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || TCHAR.contains(&b))
    {
        return bad("the header name must be a token like Authorization or X-Api-Key");
    }
    if template.matches("{}").count() != 1 {
        return bad("the template must contain {} exactly once (where the value goes)");
    }
    if header.len() > 1024 {
        return bad("longer than 1024 bytes");
    }
    Ok(())
}

pub fn check_value(value: &str) -> ControlResult<()> {
    if value.is_empty() || value.len() > MAX_SECRET_BYTES {
        return Err(ControlError::invalid(format!(
            "the secret value must have 1 to {MAX_SECRET_BYTES} bytes, got {}",
            value.len()
        )));
    }
    if value.contains(['\r', '\n', '\0']) {
        return Err(ControlError::invalid(
            "the secret value must not contain CR, LF or NUL",
        ));
    }
    Ok(())
}

pub fn check_hosts(hosts: &[String]) -> ControlResult<()> {
    if hosts.is_empty() {
        return Err(ControlError::invalid(
            "a secret needs at least one host it may be sent to",
        ));
    }
    if hosts.len() > 64 {
        return Err(ControlError::invalid("at most 64 hosts per secret"));
    }
    for h in hosts {
        space_node_api::policy::parse_host_pattern(h)
            .map_err(|e| ControlError::invalid(e.to_string()))?;
    }
    Ok(())
}

/// A secret's metadata (E2B's limits): at most 32 entries, keys 1..=128 bytes, values up to
/// 1024, 8192 bytes in all, no control characters.
pub fn check_metadata(m: &BTreeMap<String, String>) -> ControlResult<()> {
    if m.len() > 32 {
        return Err(ControlError::invalid(
            "at most 32 metadata entries per secret",
        ));
    }
    let mut total = 0;
    for (k, v) in m {
        total += k.len() + v.len();
        if k.is_empty()
            || k.len() > 128
            || v.len() > 1024
            || k.chars().chain(v.chars()).any(char::is_control)
        {
            return Err(ControlError::invalid(format!(
                "invalid metadata entry {k:?}: keys are 1..=128 bytes, values up to 1024, no \
                 control characters"
            )));
        }
    }
    if total > 8192 {
        return Err(ControlError::invalid(
            "a secret's metadata holds at most 8192 bytes",
        ));
    }
    Ok(())
}

/// Checks a whole `PUT /v1/secrets/{name}`.
pub fn validate_put(name: &str, req: &PutSecret) -> ControlResult<()> {
    check_name(name)?;
    check_hosts(&req.hosts)?;
    check_header(&req.header)?;
    check_value(&req.value)
}

/// A fresh placeholder: `spc_ph_` + 32 lowercase hex digits.
pub fn new_placeholder() -> String {
    use rand::Rng;
    let bytes: [u8; 16] = rand::rng().random();
    let mut s = String::with_capacity(PLACEHOLDER_PREFIX.len() + 32);
    s.push_str(PLACEHOLDER_PREFIX);
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// How the vault, the node's egress proxy and the sealing name secret `name` of `tenant`:
/// the name alone for `default` (so that secrets sealed before tenants still open), else
/// `tenant/name` (no tenant id or secret name holds a `/`).
pub fn vault_key(tenant: &str, name: &str) -> String {
    if tenant == DEFAULT_TENANT {
        name.to_owned()
    } else {
        format!("{tenant}/{name}")
    }
}

/// `(tenant, name)` of a [`vault_key`].
fn split_key(key: &str) -> (&str, &str) {
    key.split_once('/').unwrap_or((DEFAULT_TENANT, key))
}

// ---------------------------------------------------------------- store

/// A row of table `secrets` (the value sealed).
#[derive(Clone, PartialEq, Eq)]
pub struct SecretRow {
    pub tenant: String,
    pub name: String,
    /// Empty for a secret made through E2B's API (usable in `secret_headers` only).
    pub hosts: Vec<String>,
    pub header: String,
    pub version: i64,
    pub metadata: BTreeMap<String, String>,
    pub nonce: Vec<u8>,
    pub ciphertext: Vec<u8>,
    pub created_at: i64,
    pub updated_at: i64,
}

impl std::fmt::Debug for SecretRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretRow")
            .field("tenant", &self.tenant)
            .field("name", &self.name)
            .field("hosts", &self.hosts)
            .field("header", &self.header)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl From<&SecretRow> for SecretInfo {
    fn from(r: &SecretRow) -> Self {
        SecretInfo {
            name: r.name.clone(),
            tenant: r.tenant.clone(),
            hosts: r.hosts.clone(),
            header: r.header.clone(),
            version: r.version.max(1) as u64,
            metadata: r.metadata.clone(),
            created_at: rfc3339_from_unix_ms(r.created_at),
            updated_at: rfc3339_from_unix_ms(r.updated_at),
        }
    }
}

fn q(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { what, source }
}

fn decode(r: &AnyRow) -> Result<SecretRow, StoreError> {
    let name: String = r.try_get("name").map_err(q("decode secret"))?;
    let corrupt = |reason: &str| StoreError::Corrupt {
        id: format!("secret {name}"),
        reason: reason.to_string(),
    };
    let hosts: String = r.try_get("hosts").map_err(q("decode secret"))?;
    let nonce: String = r.try_get("nonce").map_err(q("decode secret"))?;
    let ct: String = r.try_get("ciphertext").map_err(q("decode secret"))?;
    let metadata: String = r.try_get("metadata").map_err(q("decode secret"))?;
    Ok(SecretRow {
        hosts: serde_json::from_str(&hosts).map_err(|_| corrupt("bad hosts"))?,
        header: r.try_get("header").map_err(q("decode secret"))?,
        version: r.try_get("version").map_err(q("decode secret"))?,
        metadata: serde_json::from_str(&metadata).map_err(|_| corrupt("bad metadata"))?,
        nonce: B64.decode(nonce).map_err(|_| corrupt("bad nonce"))?,
        ciphertext: B64.decode(ct).map_err(|_| corrupt("bad ciphertext"))?,
        created_at: r.try_get("created_at").map_err(q("decode secret"))?,
        updated_at: r.try_get("updated_at").map_err(q("decode secret"))?,
        tenant: r.try_get("tenant_id").map_err(q("decode secret"))?,
        name,
    })
}

const COLUMNS: &str = "tenant_id, name, hosts, header, version, metadata, nonce, ciphertext, \
     created_at, updated_at";

impl Store {
    /// Creates or replaces a secret (keeping its `created_at`). Returns the stored row.
    pub async fn put_secret(&self, row: &SecretRow) -> Result<(), StoreError> {
        let json = |v: Result<String, serde_json::Error>| {
            v.map_err(|e| StoreError::Corrupt {
                id: format!("secret {}", row.name),
                reason: e.to_string(),
            })
        };
        let hosts = json(serde_json::to_string(&row.hosts))?;
        let metadata = json(serde_json::to_string(&row.metadata))?;
        sqlx::query(
            "INSERT INTO secrets (tenant_id, name, hosts, header, version, metadata, nonce, \
             ciphertext, created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) \
             ON CONFLICT (tenant_id, name) DO UPDATE SET hosts = excluded.hosts, header = excluded.header, \
             version = excluded.version, metadata = excluded.metadata, \
             nonce = excluded.nonce, ciphertext = excluded.ciphertext, \
             updated_at = excluded.updated_at",
        )
        .bind(&row.tenant)
        .bind(&row.name)
        .bind(hosts)
        .bind(&row.header)
        .bind(row.version)
        .bind(metadata)
        .bind(B64.encode(&row.nonce))
        .bind(B64.encode(&row.ciphertext))
        .bind(row.created_at)
        .bind(row.updated_at)
        .execute(self.pool())
        .await
        .map_err(q("put secret"))?;
        Ok(())
    }

    pub async fn get_secret(
        &self,
        tenant: &str,
        name: &str,
    ) -> Result<Option<SecretRow>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM secrets WHERE tenant_id = $1 AND name = $2"
        ))
        .bind(tenant)
        .bind(name)
        .fetch_optional(self.pool())
        .await
        .map_err(q("get secret"))?;
        row.map(|r| decode(&r)).transpose()
    }

    /// The secrets of `tenant` (of every tenant: None), by name.
    pub async fn list_secrets(&self, tenant: Option<&str>) -> Result<Vec<SecretRow>, StoreError> {
        let rows = match tenant {
            Some(t) => {
                sqlx::query(&format!(
                    "SELECT {COLUMNS} FROM secrets WHERE tenant_id = $1 ORDER BY name"
                ))
                .bind(t)
                .fetch_all(self.pool())
                .await
            }
            None => {
                sqlx::query(&format!(
                    "SELECT {COLUMNS} FROM secrets ORDER BY tenant_id, name"
                ))
                .fetch_all(self.pool())
                .await
            }
        }
        .map_err(q("list secrets"))?;
        rows.iter().map(decode).collect()
    }

    /// Returns false when there was no such secret.
    pub async fn delete_secret(&self, tenant: &str, name: &str) -> Result<bool, StoreError> {
        let res = sqlx::query("DELETE FROM secrets WHERE tenant_id = $1 AND name = $2")
            .bind(tenant)
            .bind(name)
            .execute(self.pool())
            .await
            .map_err(q("delete secret"))?;
        Ok(res.rows_affected() > 0)
    }
}

// ---------------------------------------------------------------- the vault

/// Secrets: the store, the cipher and a small cache of opened values (cleared on every
/// change). The node's egress proxy asks it through [`SecretSource`].
pub struct SecretVault {
    store: Store,
    cipher: SecretCipher,
    cache: Mutex<HashMap<String, Arc<str>>>,
}

/// Values kept in the cache at most (it is cleared wholesale past that).
const CACHE_MAX: usize = 1024;

impl SecretVault {
    /// Opens the vault with the key at `key_path` (created on first use; see
    /// [`load_or_create_key`]).
    pub fn open(store: Store, key_path: &Path) -> Result<Self, KeyFileError> {
        let key = load_or_create_key(key_path)?;
        warn_if_loose(key_path);
        Ok(Self {
            store,
            cipher: SecretCipher::new(&key),
            cache: Mutex::default(),
        })
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<str>>> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this vault's key opens the secrets the store holds (true when it holds none):
    /// a control-plane replica started with another `secrets.key` than the others' would
    /// otherwise fail each secret only when a request needs it.
    pub async fn key_opens_stored(&self) -> Result<bool, StoreError> {
        Ok(match self.store.list_secrets(None).await?.first() {
            Some(row) => self
                .cipher
                .open(
                    &vault_key(&row.tenant, &row.name),
                    &row.nonce,
                    &row.ciphertext,
                )
                .is_some(),
            None => true,
        })
    }

    /// The value of the secret `key` names ([`vault_key`]), if it exists and opens.
    pub async fn value(&self, key: &str) -> Option<Arc<str>> {
        if let Some(v) = self.cache().get(key) {
            return Some(v.clone());
        }
        let (tenant, name) = split_key(key);
        let row = match self.store.get_secret(tenant, name).await {
            Ok(Some(r)) => r,
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!(secret = name, error = %crate::error_chain(&e), "secret lookup failed");
                return None;
            }
        };
        let Some(plain) = self.cipher.open(key, &row.nonce, &row.ciphertext) else {
            tracing::error!(
                secret = key,
                "secret does not open with secrets.key (wrong key file?)"
            );
            return None;
        };
        let value: Arc<str> = String::from_utf8(plain).ok()?.into();
        let mut cache = self.cache();
        if cache.len() >= CACHE_MAX {
            cache.clear();
        }
        cache.insert(key.to_string(), value.clone());
        Some(value)
    }

    pub async fn put(
        &self,
        tenant: &str,
        name: &str,
        req: &PutSecret,
    ) -> ControlResult<SecretInfo> {
        validate_put(name, req)?;
        let old = self.store.get_secret(tenant, name).await?;
        let metadata = old.as_ref().map(|o| o.metadata.clone()).unwrap_or_default();
        let row = self
            .write(
                tenant,
                name,
                &req.value,
                req.hosts.clone(),
                req.header.clone(),
                metadata,
                old,
            )
            .await?;
        tracing::info!(tenant, secret = name, hosts = ?row.hosts, version = row.version, "secret set");
        Ok(SecretInfo::from(&row))
    }

    /// Seals `value` and stores the secret as the next version of `old` (or version 1).
    #[allow(clippy::too_many_arguments)]
    async fn write(
        &self,
        tenant: &str,
        name: &str,
        value: &str,
        hosts: Vec<String>,
        header: String,
        metadata: BTreeMap<String, String>,
        old: Option<SecretRow>,
    ) -> ControlResult<SecretRow> {
        let key = vault_key(tenant, name);
        let (nonce, ciphertext) = self.cipher.seal(&key, value.as_bytes())?;
        let now = now_ms();
        let row = SecretRow {
            tenant: tenant.to_string(),
            name: name.to_string(),
            hosts,
            header,
            version: old.as_ref().map_or(1, |o| o.version + 1),
            metadata,
            nonce: nonce.to_vec(),
            ciphertext,
            created_at: old.as_ref().map_or(now, |o| o.created_at),
            updated_at: now,
        };
        self.store.put_secret(&row).await?;
        self.cache().remove(&key);
        Ok(row)
    }

    /// E2B's `POST /secrets`: a new secret with no hosts of its own (409 when the name is
    /// taken). Only headers the proxy sets can use it.
    pub async fn create_unbound(
        &self,
        tenant: &str,
        name: &str,
        value: &str,
        metadata: BTreeMap<String, String>,
    ) -> ControlResult<SecretInfo> {
        check_name(name)?;
        check_value(value)?;
        check_metadata(&metadata)?;
        if self.store.get_secret(tenant, name).await?.is_some() {
            return Err(ControlError::conflict(format!(
                "secret {name} already exists"
            )));
        }
        let row = self
            .write(
                tenant,
                name,
                value,
                Vec::new(),
                String::new(),
                metadata,
                None,
            )
            .await?;
        tracing::info!(tenant, secret = name, "secret created");
        Ok(SecretInfo::from(&row))
    }

    /// E2B's `POST /secrets/{id}`: a new value as the next version, with new metadata when
    /// given; hosts and header stay as they are.
    pub async fn update_value(
        &self,
        tenant: &str,
        name: &str,
        value: &str,
        metadata: Option<BTreeMap<String, String>>,
    ) -> ControlResult<SecretInfo> {
        check_name(name)?;
        check_value(value)?;
        if let Some(m) = &metadata {
            check_metadata(m)?;
        }
        let old = self
            .store
            .get_secret(tenant, name)
            .await?
            .ok_or_else(|| ControlError::not_found(format!("secret {name} not found")))?;
        let (hosts, header) = (old.hosts.clone(), old.header.clone());
        let metadata = metadata.unwrap_or_else(|| old.metadata.clone());
        let row = self
            .write(tenant, name, value, hosts, header, metadata, Some(old))
            .await?;
        tracing::info!(
            tenant,
            secret = name,
            version = row.version,
            "secret updated"
        );
        Ok(SecretInfo::from(&row))
    }

    pub async fn get(&self, tenant: &str, name: &str) -> ControlResult<SecretInfo> {
        check_name(name)?;
        self.store
            .get_secret(tenant, name)
            .await?
            .map(|r| SecretInfo::from(&r))
            .ok_or_else(|| ControlError::not_found(format!("secret {name} not found")))
    }

    /// The secrets of `tenant`, by name.
    pub async fn list(&self, tenant: &str) -> ControlResult<Vec<SecretInfo>> {
        Ok(self
            .store
            .list_secrets(Some(tenant))
            .await?
            .iter()
            .map(SecretInfo::from)
            .collect())
    }

    pub async fn delete(&self, tenant: &str, name: &str) -> ControlResult<()> {
        check_name(name)?;
        let existed = self.store.delete_secret(tenant, name).await?;
        self.cache().remove(&vault_key(tenant, name));
        if !existed {
            return Err(ControlError::not_found(format!("secret {name} not found")));
        }
        tracing::info!(tenant, secret = name, "secret deleted");
        Ok(())
    }

    /// The bindings of a new sandbox of `tenant` using `names`: each must be a secret of
    /// that tenant, appear once, and not collide with an environment variable the request
    /// sets.
    pub async fn bind(
        &self,
        tenant: &str,
        names: &[String],
        env: &std::collections::BTreeMap<String, String>,
    ) -> ControlResult<Vec<SecretBindingRecord>> {
        if names.len() > 64 {
            return Err(ControlError::invalid("at most 64 secrets per sandbox"));
        }
        let mut out: Vec<SecretBindingRecord> = Vec::with_capacity(names.len());
        for name in names {
            check_name(name)?;
            if out.iter().any(|b| &b.name == name) {
                return Err(ControlError::invalid(format!(
                    "secret {name} is listed twice"
                )));
            }
            if env.contains_key(name) {
                return Err(ControlError::invalid(format!(
                    "env var {name} is already set; secret {name} would replace it"
                )));
            }
            if !is_valid_env_key(name) {
                return Err(ControlError::invalid(format!(
                    "secret {name} cannot be an environment variable (letters, digits and _ \
                     only); name it in secret_headers instead"
                )));
            }
            let row = self.existing(tenant, name).await?;
            if row.hosts.is_empty() {
                return Err(ControlError::invalid(format!(
                    "secret {name} has no hosts of its own (it was made through E2B's API): \
                     name it in secret_headers, or give it hosts and a header with \
                     PUT /v1/secrets/{name}"
                )));
            }
            out.push(SecretBindingRecord {
                name: name.clone(),
                placeholder: new_placeholder(),
                hosts: row.hosts,
                header: row.header,
                inject: false,
                tenant: tenant_field(tenant),
            });
        }
        Ok(out)
    }

    /// The secret `name` for a binding (400, not 404, when it does not exist: the request
    /// that names it is what is wrong).
    async fn existing(&self, tenant: &str, name: &str) -> ControlResult<SecretRow> {
        self.store
            .get_secret(tenant, name)
            .await?
            .ok_or_else(|| ControlError::invalid(format!("secret {name} not found")))
    }

    /// The bindings of a new sandbox's `secret_headers`: headers the proxy sets (`inject`),
    /// with no placeholder. Each secret must exist; one bound to hosts of its own may only go
    /// to those; `taken` bindings count towards the limit of 64.
    pub async fn bind_headers(
        &self,
        tenant: &str,
        headers: &[SecretHeader],
        taken: usize,
    ) -> ControlResult<Vec<SecretBindingRecord>> {
        if headers.len() + taken > 64 {
            return Err(ControlError::invalid("at most 64 secrets per sandbox"));
        }
        let mut out: Vec<SecretBindingRecord> = Vec::with_capacity(headers.len());
        for h in headers {
            check_name(&h.secret)?;
            check_hosts(&h.hosts)?;
            check_header(&h.header)?;
            let row = self.existing(tenant, &h.secret).await?;
            if let Some(host) = h.hosts.iter().find(|host| !host_allowed(&row.hosts, host)) {
                return Err(ControlError::invalid(format!(
                    "secret {} may only be sent to {}, not to {host}",
                    h.secret,
                    row.hosts.join(", ")
                )));
            }
            let name_of =
                |header: &str| header.split(':').next().unwrap_or("").trim().to_lowercase();
            let clash = out.iter().find(|b| {
                name_of(&b.header) == name_of(&h.header)
                    && b.hosts.iter().any(|x| h.hosts.contains(x))
            });
            if let Some(b) = clash {
                return Err(ControlError::invalid(format!(
                    "two headers named {} for the same host ({} and {})",
                    name_of(&h.header),
                    b.name,
                    h.secret
                )));
            }
            out.push(SecretBindingRecord {
                name: h.secret.clone(),
                placeholder: String::new(),
                hosts: h.hosts.clone(),
                header: h.header.clone(),
                inject: true,
                tenant: tenant_field(tenant),
            });
        }
        Ok(out)
    }
}

/// A binding's tenant as stored: none for `default` (as bindings made before tenants are).
fn tenant_field(tenant: &str) -> Option<String> {
    (tenant != DEFAULT_TENANT).then(|| tenant.to_owned())
}

#[async_trait]
impl SecretSource for SecretVault {
    async fn secret_value(&self, name: &str) -> Option<String> {
        self.value(name).await.map(|v| v.to_string())
    }
}

/// Whether a header rule's `host` stays within a secret's own `hosts` (any host, for a
/// secret with none): a name one of them matches, or one of them exactly.
fn host_allowed(own: &[String], host: &str) -> bool {
    own.is_empty()
        || own.iter().any(|o| o.trim() == host.trim())
        || (!host.trim().starts_with("*.") && space_node_api::policy::matches_host(own, host))
}

// ---------------------------------------------------------------- engine + http

impl Engine {
    /// The secret source the node's egress proxy asks (same vault as the API).
    pub fn secret_source(&self) -> Arc<dyn SecretSource> {
        self.vault.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = DEFAULT_TENANT;

    #[test]
    fn key_files_are_made_once_0600_and_wrong_sizes_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secrets.key");
        let k1 = load_or_create_key(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(load_or_create_key(&path).unwrap(), k1);
        assert_ne!(k1, [0u8; KEY_LEN]);
        std::fs::write(&path, b"short").unwrap();
        let e = load_or_create_key(&path).unwrap_err();
        assert!(matches!(e, KeyFileError::Size { len: 5, .. }), "{e}");
        assert!(e.to_string().contains("secrets.key"), "{e}");
        // Nothing was replaced.
        assert_eq!(std::fs::read(&path).unwrap(), b"short");
        // No temporary files left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn sealing_binds_value_to_key_nonce_and_name() {
        let c = SecretCipher::new(&[7u8; KEY_LEN]);
        let (nonce, sealed) = c.seal("A", b"sk-live-123").unwrap();
        assert!(!sealed.windows(11).any(|w| w == b"sk-live-123"));
        assert_eq!(c.open("A", &nonce, &sealed).unwrap(), b"sk-live-123");
        assert!(c.open("B", &nonce, &sealed).is_none());
        let mut tampered = sealed.clone();
        tampered[0] ^= 1;
        assert!(c.open("A", &nonce, &tampered).is_none());
        assert!(c.open("A", &[0u8; 12], &sealed).is_none());
        assert!(c.open("A", &[0u8; 3], &sealed).is_none());
        let other = SecretCipher::new(&[8u8; KEY_LEN]);
        assert!(other.open("A", &nonce, &sealed).is_none());
        // Fresh nonces: the same value seals differently.
        let (nonce2, sealed2) = c.seal("A", b"sk-live-123").unwrap();
        assert_ne!((nonce, &sealed), (nonce2, &sealed2));
    }

    #[test]
    fn headers() {
        for ok in [
            "Authorization: Bearer {}",
            "X-Api-Key:{}",
            "x-goog-api-key: {}",
            "Authorization: token {} ",
        ] {
            check_header(ok).unwrap();
        }
        for bad in [
            "Authorization Bearer {}",
            "Authorization: Bearer",
            "Authorization: {} {}",
            "Authorization: Bearer {}\r\nX-Evil: 1",
            "Authorization: Bearer {}\n",
            "Author ization: {}",
            ": {}",
            "Authorization: \0{}",
        ] {
            let e = check_header(bad).unwrap_err();
            assert_eq!(e.code(), "invalid_argument", "{bad:?}");
        }
    }

    #[test]
    fn values_names_hosts() {
        check_value("x").unwrap();
        check_value(&"v".repeat(MAX_SECRET_BYTES)).unwrap();
        for bad in ["", "a\nb", "a\rb", "a\0b"] {
            assert!(check_value(bad).is_err(), "{bad:?}");
        }
        let e = check_value(&"v".repeat(MAX_SECRET_BYTES + 1)).unwrap_err();
        assert!(e.message.contains("8192"), "{}", e.message);
        check_name("OPENAI_API_KEY").unwrap();
        assert!(check_name("1A").is_err());
        assert!(check_name("A B").is_err());
        check_name("openai-key").unwrap();
        check_hosts(&["api.openai.com".into(), "*.example.com".into()]).unwrap();
        for bad in [
            vec![],
            vec!["*".to_string()],
            vec!["*.com".to_string()],
            vec!["1.2.3.4".to_string()],
            vec!["api.x.com".to_string(), "com".to_string()],
        ] {
            let e = check_hosts(&bad).unwrap_err();
            assert_eq!(e.code(), "invalid_argument", "{bad:?}");
        }
        let e = check_hosts(&["*.com".to_string()]).unwrap_err();
        assert!(e.message.contains("*.com"), "{}", e.message);
    }

    #[test]
    fn placeholders() {
        let p = new_placeholder();
        assert_eq!(p.len(), PLACEHOLDER_PREFIX.len() + 32);
        assert!(p.starts_with("spc_ph_"));
        assert!(
            p[7..]
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        );
        assert_ne!(p, new_placeholder());
    }

    #[tokio::test]
    async fn vault_roundtrip_cache_invalidation_and_sealed_at_rest() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("t.db")).await.unwrap();
        let vault = SecretVault::open(store.clone(), &dir.path().join("secrets.key")).unwrap();
        let put = |v: &str| PutSecret {
            value: v.into(),
            hosts: vec!["api.x.com".into()],
            header: "Authorization: Bearer {}".into(),
        };
        assert!(vault.secret_value("K").await.is_none());
        let info = vault.put(D, "K", &put("first-value")).await.unwrap();
        assert_eq!(info.name, "K");
        assert_eq!(
            vault.secret_value("K").await.as_deref(),
            Some("first-value")
        );
        // Replacing keeps created_at and is seen at once (cache cleared).
        let info2 = vault.put(D, "K", &put("second-value")).await.unwrap();
        assert_eq!(info2.created_at, info.created_at);
        assert_eq!(
            vault.secret_value("K").await.as_deref(),
            Some("second-value")
        );
        // At rest: no plaintext in the row.
        let raw: String = sqlx::query("SELECT ciphertext FROM secrets WHERE name = 'K'")
            .fetch_one(store.pool())
            .await
            .unwrap()
            .try_get(0)
            .unwrap();
        assert!(!raw.contains("second-value"));
        assert_eq!(vault.list(D).await.unwrap().len(), 1);
        vault.delete(D, "K").await.unwrap();
        assert!(vault.secret_value("K").await.is_none());
        assert_eq!(vault.delete(D, "K").await.unwrap_err().code(), "not_found");
        assert_eq!(vault.get(D, "K").await.unwrap_err().code(), "not_found");

        // A vault with another key cannot open what this one sealed.
        vault.put(D, "K", &put("v")).await.unwrap();
        std::fs::write(dir.path().join("other.key"), [1u8; KEY_LEN]).unwrap();
        let other = SecretVault::open(store, &dir.path().join("other.key")).unwrap();
        assert!(other.secret_value("K").await.is_none());
        // Which a replica started with it finds out at once.
        assert!(vault.key_opens_stored().await.unwrap());
        assert!(!other.key_opens_stored().await.unwrap());
    }

    #[tokio::test]
    async fn a_name_is_two_secrets_in_two_tenants_and_a_sealed_value_stays_in_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("t.db")).await.unwrap();
        let vault = SecretVault::open(store.clone(), &dir.path().join("secrets.key")).unwrap();
        let put = |v: &str| PutSecret {
            value: v.into(),
            hosts: vec!["api.x.com".into()],
            header: "X-Key: {}".into(),
        };
        vault.put(D, "K", &put("default-value")).await.unwrap();
        let info = vault.put("acme", "K", &put("acme-value")).await.unwrap();
        assert_eq!((info.name.as_str(), info.tenant.as_str()), ("K", "acme"));
        assert_eq!(
            vault.secret_value("K").await.as_deref(),
            Some("default-value")
        );
        assert_eq!(
            vault.secret_value("acme/K").await.as_deref(),
            Some("acme-value")
        );
        assert!(vault.secret_value("other/K").await.is_none());
        assert_eq!(vault.list("acme").await.unwrap().len(), 1);
        assert!(vault.list("other").await.unwrap().is_empty());
        assert_eq!(
            vault.get("other", "K").await.unwrap_err().code(),
            "not_found"
        );
        assert_eq!(
            vault.delete("other", "K").await.unwrap_err().code(),
            "not_found"
        );
        // A tenant binds its own secret; another tenant's name is not found.
        let env = BTreeMap::new();
        let b = vault.bind("acme", &["K".into()], &env).await.unwrap();
        assert_eq!(b[0].tenant.as_deref(), Some("acme"));
        let e = vault.bind("other", &["K".into()], &env).await.unwrap_err();
        assert_eq!(e.message, "secret K not found");
        // A row moved to another tenant by hand does not open there.
        sqlx::query("UPDATE secrets SET tenant_id = 'other' WHERE tenant_id = 'acme'")
            .execute(store.pool())
            .await
            .unwrap();
        assert!(vault.value("other/K").await.is_none());
        // Deleting one tenant's leaves the other's.
        vault.delete(D, "K").await.unwrap();
        assert!(vault.secret_value("K").await.is_none());
        assert_eq!(vault.list("other").await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn binding_checks_names_existence_and_env() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("t.db")).await.unwrap();
        let vault = SecretVault::open(store, &dir.path().join("secrets.key")).unwrap();
        vault
            .put(
                D,
                "K",
                &PutSecret {
                    value: "v".into(),
                    hosts: vec!["api.x.com".into()],
                    header: "X-Key: {}".into(),
                },
            )
            .await
            .unwrap();
        let env = std::collections::BTreeMap::new();
        let b = vault.bind(D, &["K".into()], &env).await.unwrap();
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].hosts, vec!["api.x.com"]);
        assert_eq!(b[0].header, "X-Key: {}");
        assert!(b[0].placeholder.starts_with(PLACEHOLDER_PREFIX));
        let e = vault.bind(D, &["NOPE".into()], &env).await.unwrap_err();
        assert_eq!(e.message, "secret NOPE not found");
        assert_eq!(e.http_status().as_u16(), 400);
        let e = vault
            .bind(D, &["K".into(), "K".into()], &env)
            .await
            .unwrap_err();
        assert_eq!(e.code(), "invalid_argument");
        let env = std::collections::BTreeMap::from([("K".to_string(), "x".to_string())]);
        let e = vault.bind(D, &["K".into()], &env).await.unwrap_err();
        assert!(e.message.contains("env var K"), "{}", e.message);
    }

    #[tokio::test]
    async fn unbound_secrets_have_versions_and_go_in_headers_only() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("t.db")).await.unwrap();
        let vault = SecretVault::open(store, &dir.path().join("secrets.key")).unwrap();
        let meta = BTreeMap::from([("team".to_string(), "a".to_string())]);
        let i = vault
            .create_unbound(D, "api-key", "v1", meta.clone())
            .await
            .unwrap();
        assert_eq!(
            (i.version, i.hosts.len(), i.metadata.clone()),
            (1, 0, meta.clone())
        );
        let e = vault
            .create_unbound(D, "api-key", "v", BTreeMap::new())
            .await
            .unwrap_err();
        assert_eq!(e.http_status().as_u16(), 409);
        let i = vault.update_value(D, "api-key", "v2", None).await.unwrap();
        assert_eq!((i.version, i.metadata), (2, meta));
        assert_eq!(vault.value("api-key").await.as_deref(), Some("v2"));
        let i = vault
            .update_value(D, "api-key", "v3", Some(BTreeMap::new()))
            .await
            .unwrap();
        assert_eq!((i.version, i.metadata.len()), (3, 0));
        assert_eq!(
            vault
                .update_value(D, "nope", "v", None)
                .await
                .unwrap_err()
                .kind,
            crate::ErrorKind::NotFound
        );
        let too_many: BTreeMap<String, String> = (0..33)
            .map(|i| (format!("k{i}"), "v".to_string()))
            .collect();
        assert!(vault.create_unbound(D, "x", "v", too_many).await.is_err());

        // Not as a placeholder: it has no hosts, and its name is no env var.
        let env = BTreeMap::new();
        let e = vault.bind(D, &["api-key".into()], &env).await.unwrap_err();
        assert!(e.message.contains("environment variable"), "{}", e.message);
        vault
            .create_unbound(D, "API_KEY", "v", BTreeMap::new())
            .await
            .unwrap();
        let e = vault.bind(D, &["API_KEY".into()], &env).await.unwrap_err();
        assert!(e.message.contains("no hosts"), "{}", e.message);

        // In a header: any host for an unbound secret, only its own for a bound one.
        let h = |secret: &str, host: &str, header: &str| SecretHeader {
            secret: secret.into(),
            hosts: vec![host.into()],
            header: header.into(),
        };
        let b = vault
            .bind_headers(
                D,
                &[h("api-key", "api.x.com", "Authorization: Bearer {}")],
                0,
            )
            .await
            .unwrap();
        assert_eq!((b[0].inject, b[0].placeholder.as_str()), (true, ""));
        vault
            .put(
                D,
                "BOUND",
                &PutSecret {
                    value: "v".into(),
                    hosts: vec!["*.y.com".into()],
                    header: "X: {}".into(),
                },
            )
            .await
            .unwrap();
        vault
            .bind_headers(D, &[h("BOUND", "a.y.com", "X: {}")], 0)
            .await
            .unwrap();
        vault
            .bind_headers(D, &[h("BOUND", "*.y.com", "X: {}")], 0)
            .await
            .unwrap();
        let e = vault
            .bind_headers(D, &[h("BOUND", "evil.com", "X: {}")], 0)
            .await
            .unwrap_err();
        assert!(
            e.message.contains("may only be sent to *.y.com"),
            "{}",
            e.message
        );
        let e = vault
            .bind_headers(
                D,
                &[
                    h("api-key", "a.x.com", "X: {}"),
                    h("API_KEY", "a.x.com", "x: {} 2"),
                ],
                0,
            )
            .await
            .unwrap_err();
        assert!(e.message.contains("two headers named x"), "{}", e.message);
        for (bad, why) in [
            (h("nope", "a.x.com", "X: {}"), "not found"),
            (h("api-key", "a.x.com", "X: no marker"), "{}"),
            (h("api-key", "*", "X: {}"), "*"),
        ] {
            let e = vault.bind_headers(D, &[bad], 0).await.unwrap_err();
            assert!(e.message.contains(why), "{why}: {}", e.message);
        }
        let e = vault
            .bind_headers(D, &[h("api-key", "a.x.com", "X: {}")], 64)
            .await
            .unwrap_err();
        assert!(e.message.contains("64"), "{}", e.message);
    }
}
