//! API keys: `sk_` + 40 base62 characters. Only sha256 hashes are stored; the admin key's
//! plaintext is written once to `data_dir/admin.key` (mode 0600). Verification hashes the
//! presented key and compares it with every live key's hash in constant time, and answers
//! who the key is ([`Principal`]: its tenant and scope, decision 0040).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use rand::Rng;
use sha2::{Digest, Sha256};

use space_api::tenant::{ApiKey, CreateKey, CreatedKey, DEFAULT_TENANT, KeyScope, RotateKey};

use crate::error::{ControlError, ControlResult};
use crate::store::{Store, StoreError, now_ms};
use crate::tenants::{KeyRow, Principal};

pub const ADMIN_KEY_FILE: &str = "admin.key";
const ADMIN_KEY_NAME: &str = "admin";
const KEY_PREFIX: &str = "sk_";
const KEY_RANDOM_CHARS: usize = 40;
/// Characters of a key's id (random, shown in lists and audit records).
const KEY_ID_CHARS: usize = 16;
/// A rotation's default and longest overlap.
const DEFAULT_OVERLAP_SECS: u64 = 3600;
const MAX_OVERLAP_SECS: u64 = 7 * 24 * 3600;
/// How often a replica reads the key table again (revocations made through another replica
/// reach it within this).
pub const RELOAD_EVERY: std::time::Duration = std::time::Duration::from_secs(1);
const BASE62: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("failed to write {path}")]
    WriteKey {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A fresh random API key.
pub fn generate_key() -> String {
    let mut rng = rand::rng();
    let mut key = String::with_capacity(KEY_PREFIX.len() + KEY_RANDOM_CHARS);
    key.push_str(KEY_PREFIX);
    for _ in 0..KEY_RANDOM_CHARS {
        key.push(BASE62[rng.random_range(0..BASE62.len())] as char);
    }
    key
}

pub fn hash_key(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

pub(crate) fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn from_hex(s: &str) -> Option<[u8; 32]> {
    from_hex_bytes(s)?.try_into().ok()
}

/// Compares two hashes without an early exit.
fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b.iter()) {
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

/// A fresh key id.
fn new_key_id() -> String {
    generate_key()[KEY_PREFIX.len()..KEY_PREFIX.len() + KEY_ID_CHARS].to_string()
}

/// A live key as the cache holds it.
#[derive(Debug, Clone)]
struct CachedKey {
    hash: [u8; 32],
    principal: Principal,
    expires_at: Option<i64>,
}

/// The live keys, loaded from the store and cached in memory.
#[derive(Debug, Default)]
pub struct Auth {
    keys: RwLock<Vec<CachedKey>>,
    /// When a key the cache did not know last made it read the keys
    /// ([`Auth::verify_request_or_reload`]).
    missed_at: std::sync::Mutex<Option<std::time::Instant>>,
}

/// How often keys the cache does not know make it read the keys again: a key created
/// through another replica works here at once, and bad keys cost at most four reads a
/// second.
const RELOAD_ON_MISS_AFTER: std::time::Duration = std::time::Duration::from_millis(250);

impl Auth {
    pub async fn load(store: &Store) -> Result<Self, AuthError> {
        let auth = Self::default();
        auth.reload(store).await?;
        Ok(auth)
    }

    pub async fn reload(&self, store: &Store) -> Result<(), AuthError> {
        let now = now_ms();
        let keys: Vec<CachedKey> = store
            .api_keys()
            .await?
            .into_iter()
            .filter(|k| k.live(now))
            .filter_map(|k| {
                Some(CachedKey {
                    hash: from_hex(&k.hash)?,
                    principal: Principal {
                        rate_per_sec: k.rate(),
                        key_id: k.id,
                        tenant: k.tenant,
                        scope: k.scope,
                    },
                    expires_at: k.expires_at,
                })
            })
            .collect();
        *self.keys.write().unwrap_or_else(|e| e.into_inner()) = keys;
        Ok(())
    }

    /// [`Self::verify_request`]; a key the cache does not know makes it read the keys again
    /// first (at most every [`RELOAD_ON_MISS_AFTER`]), so a key made through another replica
    /// works here at once.
    pub async fn verify_request_or_reload(
        &self,
        store: &Store,
        headers: &axum::http::HeaderMap,
    ) -> Option<(String, Principal)> {
        if let Some(found) = self.verify_request(headers) {
            return Some(found);
        }
        presented_key(headers)?;
        {
            let mut missed = self.missed_at.lock().unwrap_or_else(|e| e.into_inner());
            if missed.is_some_and(|at| at.elapsed() < RELOAD_ON_MISS_AFTER) {
                return None;
            }
            *missed = Some(std::time::Instant::now());
        }
        if let Err(e) = self.reload(store).await {
            tracing::debug!(error = %e, "reloading the API keys failed");
            return None;
        }
        self.verify_request(headers)
    }

    /// Who `key` is, when it is a live API key. Every live key's hash is compared.
    pub fn verify(&self, key: &str) -> Option<Principal> {
        let presented = hash_key(key);
        let keys = self.keys.read().unwrap_or_else(|e| e.into_inner());
        let mut found = None;
        for k in keys.iter() {
            if ct_eq(&k.hash, &presented) {
                found = Some(k);
            }
        }
        let k = found?;
        k.expires_at
            .is_none_or(|t| now_ms() < t)
            .then(|| k.principal.clone())
    }

    /// Verifies the key a request presents ([`presented_key`]): the key and who it is.
    pub fn verify_request(&self, headers: &axum::http::HeaderMap) -> Option<(String, Principal)> {
        let key = presented_key(headers)?;
        let who = self.verify(&key)?;
        Some((key, who))
    }

    /// Drops key `id` from the cache at once (a revocation, before the answer).
    fn forget(&self, id: &str) {
        self.keys
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|k| k.principal.key_id != id);
    }

    /// `POST /v1/keys`: a new key of `req.tenant` with `req.scope`.
    pub async fn create_key(&self, store: &Store, req: &CreateKey) -> ControlResult<CreatedKey> {
        crate::tenants::check_tenant_id(&req.tenant)?;
        if !store.tenants().await?.iter().any(|t| t.id == req.tenant) {
            return Err(ControlError::not_found(format!(
                "tenant {} not found",
                req.tenant
            )));
        }
        if req.scope == KeyScope::Admin && req.tenant != DEFAULT_TENANT {
            return Err(ControlError::invalid(
                "admin keys belong to tenant default (they reach every tenant)",
            ));
        }
        let name = req
            .name
            .clone()
            .unwrap_or_else(|| req.scope.as_str().into());
        if name.is_empty() || name.len() > 64 || name.chars().any(char::is_control) {
            return Err(ControlError::invalid(
                "a key's name is 1 to 64 characters, none of them control characters",
            ));
        }
        if req.rate_per_sec == Some(0) {
            return Err(ControlError::invalid(
                "rate_per_sec must be at least 1 (leave it out for the scope's default)",
            ));
        }
        self.insert(store, &req.tenant, req.scope, &name, req.rate_per_sec)
            .await
    }

    async fn insert(
        &self,
        store: &Store,
        tenant: &str,
        scope: KeyScope,
        name: &str,
        rate_per_sec: Option<u32>,
    ) -> ControlResult<CreatedKey> {
        let key = generate_key();
        let row = KeyRow {
            id: new_key_id(),
            hash: to_hex(&hash_key(&key)),
            name: name.to_owned(),
            tenant: tenant.to_owned(),
            scope,
            created_at: now_ms(),
            expires_at: None,
            revoked_at: None,
            rate_per_sec,
        };
        store.insert_key(&row).await?;
        self.reload(store).await.map_err(ControlError::internal)?;
        tracing::info!(key = %row.id, tenant, scope = scope.as_str(), "API key created");
        Ok(CreatedKey {
            key,
            info: row.dto(),
        })
    }

    /// `GET /v1/keys`: every key (of `tenant`, when given), revoked and expired included.
    pub async fn list_keys(
        &self,
        store: &Store,
        tenant: Option<&str>,
    ) -> ControlResult<Vec<ApiKey>> {
        if let Some(t) = tenant {
            crate::tenants::check_tenant_id(t)?;
        }
        Ok(store
            .api_keys()
            .await?
            .iter()
            .filter(|k| tenant.is_none_or(|t| k.tenant == t))
            .map(KeyRow::dto)
            .collect())
    }

    async fn live_key(&self, store: &Store, id: &str) -> ControlResult<KeyRow> {
        let not_found = || ControlError::not_found(format!("key {id} not found"));
        if id.len() != KEY_ID_CHARS || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(not_found());
        }
        let k = store.api_key(id).await?.ok_or_else(not_found)?;
        if !k.live(now_ms()) {
            return Err(ControlError::conflict(format!(
                "key {id} is revoked or expired already"
            )));
        }
        Ok(k)
    }

    /// `POST /v1/keys/{id}/rotate`: a new key like `id`; `id` keeps working for the overlap.
    pub async fn rotate_key(
        &self,
        store: &Store,
        id: &str,
        req: &RotateKey,
    ) -> ControlResult<CreatedKey> {
        let overlap = req.overlap_secs.unwrap_or(DEFAULT_OVERLAP_SECS);
        if overlap > MAX_OVERLAP_SECS {
            return Err(ControlError::invalid(format!(
                "overlap_secs is at most {MAX_OVERLAP_SECS} (7 days), got {overlap}"
            )));
        }
        let old = self.live_key(store, id).await?;
        let created = self
            .insert(store, &old.tenant, old.scope, &old.name, old.rate_per_sec)
            .await?;
        store
            .expire_key(id, now_ms() + (overlap as i64) * 1000)
            .await?;
        self.reload(store).await.map_err(ControlError::internal)?;
        tracing::info!(old = id, new = %created.info.id, overlap, "API key rotated");
        Ok(created)
    }

    /// `DELETE /v1/keys/{id}`: the key fails from the next request on. The last live admin
    /// key is kept (nobody could manage the platform without one).
    pub async fn revoke_key(&self, store: &Store, id: &str) -> ControlResult<()> {
        let k = self.live_key(store, id).await?;
        if k.scope == KeyScope::Admin {
            let now = now_ms();
            let admins = store
                .api_keys()
                .await?
                .iter()
                .filter(|o| o.scope == KeyScope::Admin && o.live(now))
                .count();
            if admins <= 1 {
                return Err(ControlError::conflict(
                    "this is the last live admin key; create another one before revoking it",
                ));
            }
        }
        store.revoke_key(id).await?;
        self.forget(id);
        tracing::info!(key = id, "API key revoked");
        Ok(())
    }
}

/// Reads the key table again every [`RELOAD_EVERY`] while `auth` lives.
pub fn spawn_reload(auth: &std::sync::Arc<Auth>, store: Store) {
    let weak = std::sync::Arc::downgrade(auth);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(RELOAD_EVERY).await;
            let Some(auth) = weak.upgrade() else { return };
            if let Err(e) = auth.reload(&store).await {
                tracing::debug!(error = %e, "reloading the API keys failed; keeping the cache");
            }
        }
    });
}

/// The subprotocol that carries a key on a WebSocket, which a browser cannot give headers
/// (decision 0058): `Sec-WebSocket-Protocol: space.v1, space-key.<key>`.
pub const WS_KEY_PROTOCOL: &str = "space-key.";

/// The API key a request presents: `Authorization: Bearer <key>`, or `X-API-KEY` (what the
/// E2B SDKs send) holding the key or its E2B form ([`space_api::e2b_key`]), or on a
/// WebSocket handshake the subprotocol [`WS_KEY_PROTOCOL`]`<key>`.
pub fn presented_key(headers: &axum::http::HeaderMap) -> Option<String> {
    if let Some(key) = headers
        .get(axum::http::header::SEC_WEBSOCKET_PROTOCOL)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.split(',')
                .find_map(|p| p.trim().strip_prefix(WS_KEY_PROTOCOL))
        })
        .filter(|k| !k.is_empty())
    {
        return Some(key.to_owned());
    }
    if let Some(v) = headers.get(axum::http::header::AUTHORIZATION) {
        let (scheme, key) = v.to_str().ok()?.split_once(' ')?;
        return scheme
            .eq_ignore_ascii_case("bearer")
            .then(|| key.trim().to_string());
    }
    let v = headers.get("x-api-key")?.to_str().ok()?.trim();
    match v.strip_prefix(space_api::E2B_KEY_PREFIX) {
        Some(hex) => from_e2b_hex(hex),
        None => Some(v.to_string()),
    }
}

fn from_e2b_hex(hex: &str) -> Option<String> {
    if hex.len() > 256 {
        return None;
    }
    String::from_utf8(from_hex_bytes(hex)?).ok()
}

/// The bytes of an even number of hex digits.
pub(crate) fn from_hex_bytes(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    hex.as_bytes()
        .chunks(2)
        .map(|c| {
            let hi = (c[0] as char).to_digit(16)?;
            let lo = (c[1] as char).to_digit(16)?;
            Some((hi * 16 + lo) as u8)
        })
        .collect()
}

/// Makes sure an admin key exists and its plaintext is in `data_dir/admin.key`. Reuses the
/// file's key when its hash is stored; otherwise creates a new key (replacing older admin
/// keys). Returns the key file's path.
pub async fn ensure_admin_key(store: &Store, data_dir: &Path) -> Result<PathBuf, AuthError> {
    let path = data_dir.join(ADMIN_KEY_FILE);
    if let Ok(existing) = std::fs::read_to_string(&path) {
        let hash = to_hex(&hash_key(existing.trim()));
        if store.api_key_hashes().await?.contains(&hash) {
            return Ok(path);
        }
    }
    let key = generate_key();
    let id = new_key_id();
    // Write the file first: a key in the table that nobody can read is useless.
    write_key_file(&path, &key)?;
    store.delete_api_keys_named(ADMIN_KEY_NAME).await?;
    store
        .insert_api_key(&id, &to_hex(&hash_key(&key)), ADMIN_KEY_NAME)
        .await?;
    tracing::info!(path = %path.display(), "created the admin API key");
    Ok(path)
}

fn write_key_file(path: &Path, key: &str) -> Result<(), AuthError> {
    let err = |source| AuthError::WriteKey {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("key.tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(err)?;
    f.write_all(format!("{key}\n").as_bytes()).map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn keys_have_the_documented_shape() {
        let k = generate_key();
        assert_eq!(k.len(), 43);
        assert!(k.starts_with("sk_"));
        assert!(k[3..].bytes().all(|b| b.is_ascii_alphanumeric()));
        assert_ne!(generate_key(), k);
    }

    #[test]
    fn the_e2b_form_is_e2b_and_hex_and_maps_back() {
        let k = generate_key();
        let form = space_api::e2b_key(&k);
        assert!(form.starts_with("e2b_"));
        assert!(form[4..].bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(from_e2b_hex(&form[4..]), Some(k));
        assert_eq!(from_e2b_hex("abc"), None);
        assert_eq!(from_e2b_hex("ff"), None); // not UTF-8
    }

    #[test]
    fn hex_roundtrip_and_ct_eq() {
        let h = hash_key("x");
        assert_eq!(from_hex(&to_hex(&h)), Some(h));
        assert_eq!(from_hex("zz"), None);
        assert!(ct_eq(&h, &h));
        assert!(!ct_eq(&h, &hash_key("y")));
    }

    #[tokio::test]
    async fn admin_key_is_created_once_and_verified() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("space.db"))
            .await
            .unwrap();
        let path = ensure_admin_key(&store, dir.path()).await.unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let key = std::fs::read_to_string(&path).unwrap().trim().to_string();

        // A second start reuses the key.
        ensure_admin_key(&store, dir.path()).await.unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap().trim(), key);
        assert_eq!(store.api_key_hashes().await.unwrap().len(), 1);

        let auth = Auth::load(&store).await.unwrap();
        assert!(auth.verify(&key).is_some());
        assert!(auth.verify("sk_wrong").is_none());
        assert!(auth.verify("").is_none());
        let with = |name: &str, value: &str| {
            let mut h = axum::http::HeaderMap::new();
            h.insert(
                axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
            auth.verify_request(&h).map(|(k, _)| k)
        };
        assert_eq!(
            with("authorization", &format!("Bearer {key}")),
            Some(key.clone())
        );
        assert_eq!(
            with("authorization", &format!("bearer {key}")),
            Some(key.clone())
        );
        assert_eq!(
            with(
                "sec-websocket-protocol",
                &format!("space.v1, space-key.{key}")
            ),
            Some(key.clone())
        );
        assert_eq!(
            with("sec-websocket-protocol", "space.v1, space-key.sk_wrong"),
            None
        );
        assert_eq!(with("sec-websocket-protocol", "space.v1, space-key."), None);
        assert_eq!(with("authorization", &format!("Basic {key}")), None);
        assert_eq!(with("authorization", &key), None);
        assert_eq!(with("x-api-key", &key), Some(key.clone()));
        assert_eq!(
            with("x-api-key", &space_api::e2b_key(&key)),
            Some(key.clone())
        );
        // The E2B form of a wrong key, odd or non-hex digits, and no header at all.
        assert_eq!(with("x-api-key", &space_api::e2b_key("sk_wrong")), None);
        assert_eq!(with("x-api-key", &space_api::e2b_key(&key)[..20]), None);
        assert_eq!(with("x-api-key", "e2b_zz"), None);
        assert_eq!(auth.verify_request(&axum::http::HeaderMap::new()), None);

        // Losing the file rotates the key; the old one stops working.
        std::fs::remove_file(&path).unwrap();
        ensure_admin_key(&store, dir.path()).await.unwrap();
        let new_key = std::fs::read_to_string(&path).unwrap().trim().to_string();
        assert_ne!(new_key, key);
        auth.reload(&store).await.unwrap();
        assert!(auth.verify(&new_key).is_some());
        assert!(auth.verify(&key).is_none());
    }
}
