//! API keys: `sk_` + 40 base62 characters. Only sha256 hashes are stored; the admin key's
//! plaintext is written once to `data_dir/admin.key` (mode 0600). Verification hashes the
//! presented key and compares it with every stored hash in constant time.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use rand::Rng;
use sha2::{Digest, Sha256};

use crate::store::{Store, StoreError};

pub const ADMIN_KEY_FILE: &str = "admin.key";
const ADMIN_KEY_NAME: &str = "admin";
const KEY_PREFIX: &str = "sk_";
const KEY_RANDOM_CHARS: usize = 40;
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

/// The key hashes, loaded from the store and cached in memory.
#[derive(Debug, Default)]
pub struct Auth {
    hashes: RwLock<Vec<[u8; 32]>>,
}

impl Auth {
    pub async fn load(store: &Store) -> Result<Self, AuthError> {
        let auth = Self::default();
        auth.reload(store).await?;
        Ok(auth)
    }

    pub async fn reload(&self, store: &Store) -> Result<(), AuthError> {
        let hashes: Vec<[u8; 32]> = store
            .api_key_hashes()
            .await?
            .iter()
            .filter_map(|h| from_hex(h))
            .collect();
        *self.hashes.write().unwrap_or_else(|e| e.into_inner()) = hashes;
        Ok(())
    }

    /// Whether `key` is a valid API key. Every stored hash is compared.
    pub fn verify(&self, key: &str) -> bool {
        let presented = hash_key(key);
        let hashes = self.hashes.read().unwrap_or_else(|e| e.into_inner());
        hashes
            .iter()
            .fold(false, |found, h| ct_eq(h, &presented) | found)
    }

    /// Verifies the key a request presents ([`presented_key`]); returns it when valid.
    pub fn verify_request(&self, headers: &axum::http::HeaderMap) -> Option<String> {
        presented_key(headers).filter(|k| self.verify(k))
    }
}

/// The API key a request presents: `Authorization: Bearer <key>`, or `X-API-KEY` (what the
/// E2B SDKs send) holding the key or its E2B form ([`space_api::e2b_key`]).
pub fn presented_key(headers: &axum::http::HeaderMap) -> Option<String> {
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
    let id = generate_key()[KEY_PREFIX.len()..KEY_PREFIX.len() + 16].to_string();
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
        assert!(auth.verify(&key));
        assert!(!auth.verify("sk_wrong"));
        assert!(!auth.verify(""));
        let with = |name: &str, value: &str| {
            let mut h = axum::http::HeaderMap::new();
            h.insert(
                axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
            auth.verify_request(&h)
        };
        assert_eq!(
            with("authorization", &format!("Bearer {key}")),
            Some(key.clone())
        );
        assert_eq!(
            with("authorization", &format!("bearer {key}")),
            Some(key.clone())
        );
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
        assert!(auth.verify(&new_key));
        assert!(!auth.verify(&key));
    }
}
