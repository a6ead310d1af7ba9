//! Idempotent creates (issue 14): `POST /v1/sandboxes` with an `Idempotency-Key` header makes
//! at most one sandbox per key, whichever replica each try reaches and wherever an earlier
//! try stopped. The key is claimed in the store before anything is made, with the id the
//! sandbox will have; a retry finds it and answers that sandbox, finishing its create when
//! the try that began it died half-way.

use sha2::{Digest, Sha256};
use space_api::{CreateSandbox, Sandbox, SandboxState};

use crate::auth::to_hex;
use crate::engine::{Engine, new_sandbox_id, node_spec};
use crate::error::{ControlError, ControlResult};
use crate::store::{Store, StoreError, now_ms};

/// How long a key is remembered.
pub const KEY_TTL_MS: i64 = 24 * 3600 * 1000;
/// The longest key accepted.
pub const KEY_MAX: usize = 255;

/// What claiming a key found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// Nobody had it (or its 24 h were over): it is this create's now.
    Fresh,
    /// An earlier create has it.
    Taken {
        sandbox_id: String,
        request_sha256: String,
    },
}

fn q(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { what, source }
}

impl Store {
    /// Claims `key` for sandbox `id`, made by a request whose hash is `sha`.
    pub async fn claim_idempotency_key(
        &self,
        key: &str,
        id: &str,
        sha: &str,
    ) -> Result<Claim, StoreError> {
        use sqlx::Row;
        let now = now_ms();
        // One statement: insert, or take over a key whose time is over.
        let done = sqlx::query(
            "INSERT INTO idempotency_keys (idem_key, sandbox_id, request_sha256, created_at) \
             VALUES ($1, $2, $3, $4) \
             ON CONFLICT (idem_key) DO UPDATE SET sandbox_id = excluded.sandbox_id, \
             request_sha256 = excluded.request_sha256, created_at = excluded.created_at \
             WHERE idempotency_keys.created_at < $5",
        )
        .bind(key)
        .bind(id)
        .bind(sha)
        .bind(now)
        .bind(now - KEY_TTL_MS)
        .execute(self.pool())
        .await
        .map_err(q("claim idempotency key"))?;
        if done.rows_affected() == 1 {
            return Ok(Claim::Fresh);
        }
        let row = sqlx::query(
            "SELECT sandbox_id, request_sha256 FROM idempotency_keys WHERE idem_key = $1",
        )
        .bind(key)
        .fetch_one(self.pool())
        .await
        .map_err(q("read idempotency key"))?;
        Ok(Claim::Taken {
            sandbox_id: row.try_get(0).map_err(q("read idempotency key"))?,
            request_sha256: row.try_get(1).map_err(q("read idempotency key"))?,
        })
    }

    /// Forgets `key` (its create was refused: a retry should be refused afresh).
    pub async fn forget_idempotency_key(&self, key: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM idempotency_keys WHERE idem_key = $1")
            .bind(key)
            .execute(self.pool())
            .await
            .map_err(q("forget idempotency key"))?;
        Ok(())
    }
}

/// A key as the header carries it: 1 to 255 visible ASCII characters.
pub fn check_key(key: &str) -> ControlResult<()> {
    if key.is_empty() || key.len() > KEY_MAX || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ControlError::invalid(format!(
            "Idempotency-Key must be 1 to {KEY_MAX} visible ASCII characters"
        )));
    }
    Ok(())
}

impl Engine {
    /// `POST /v1/sandboxes`, with the request's `Idempotency-Key` when it has one. Answers
    /// the sandbox, and whether it is an earlier try's (a replay).
    pub async fn create_sandbox_keyed(
        &self,
        tenant: &str,
        req: CreateSandbox,
        key: Option<&str>,
    ) -> ControlResult<(Sandbox, bool)> {
        let Some(key) = key else {
            return Ok((self.create_sandbox_for(tenant, req).await?, false));
        };
        check_key(key)?;
        // Keys are the tenant's: two tenants' equal keys never meet (a space cannot be in
        // a key, so the scoped form is unambiguous; `default`'s keep their old form).
        let stored = if tenant == space_api::tenant::DEFAULT_TENANT {
            key.to_owned()
        } else {
            format!("{tenant} {key}")
        };
        let body = serde_json::to_vec(&req)
            .map_err(|e| ControlError::internal(format_args!("encode create: {e}")))?;
        let sha = to_hex(&Sha256::digest(&body));
        let id = new_sandbox_id();
        match self.store.claim_idempotency_key(&stored, &id, &sha).await? {
            Claim::Fresh => match self.create_with_id(tenant, req, id).await {
                Ok(sb) => Ok((sb, false)),
                Err(e) => {
                    if e.kind.is_caller_error() {
                        self.store.forget_idempotency_key(&stored).await?;
                    }
                    Err(e)
                }
            },
            Claim::Taken {
                sandbox_id,
                request_sha256,
            } => {
                if request_sha256 != sha {
                    return Err(ControlError::conflict(format!(
                        "Idempotency-Key {key:?} was used for a different create (sandbox \
                         {sandbox_id}); use a new key for a new request"
                    )));
                }
                self.replay_create(tenant, req, sandbox_id).await
            }
        }
    }

    /// A retry of a create whose key an earlier try took: that try's sandbox, its create
    /// finished here if the try stopped half-way.
    async fn replay_create(
        &self,
        tenant: &str,
        req: CreateSandbox,
        id: String,
    ) -> ControlResult<(Sandbox, bool)> {
        if self.store.get_sandbox(&id).await?.is_none() {
            // The try stopped before its row: make it now, with the id it chose. A try
            // that is still alive may insert the row meanwhile; then it is a replay.
            match self.create_with_id(tenant, req, id.clone()).await {
                Ok(sb) => return Ok((sb, false)),
                Err(e) if self.store.get_sandbox(&id).await?.is_none() => return Err(e),
                Err(_) => {}
            }
        }
        self.finish_interrupted_create(&id).await?;
        Ok((self.get_sandbox(&id).await?, true))
    }

    /// A row left `creating` by a try that stopped (its replica died, its client went
    /// away): the create is done again on the node (idempotent there) and recorded.
    async fn finish_interrupted_create(&self, id: &str) -> ControlResult<()> {
        let _guard = self.locks.lock(id).await;
        let Some(row) = self.store.get_sandbox(id).await? else {
            return Err(ControlError::not_found(format!("sandbox {id} not found")));
        };
        if row.state != SandboxState::Creating {
            return Ok(());
        }
        match self.node.create_sandbox(&node_spec(id, &row.spec)).await {
            Ok(_) => {
                self.event(
                    id,
                    "create_resolved",
                    "ok",
                    "finished by a retry of its create",
                );
                self.write_status(id, SandboxState::Running, None).await
            }
            Err(e) => {
                let err = ControlError::from(e);
                if err.kind.is_caller_error() {
                    let msg = format!("create failed: {}", err.message);
                    self.write_status(id, SandboxState::Failed, Some(&msg))
                        .await?;
                }
                Err(err)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_short_visible_ascii() {
        assert!(check_key("a").is_ok());
        assert!(check_key(&"k".repeat(KEY_MAX)).is_ok());
        assert!(check_key("order-42/retry").is_ok());
        for bad in ["", " ", "a b", "é", "a\n"] {
            assert!(check_key(bad).is_err(), "{bad:?}");
        }
        assert!(check_key(&"k".repeat(KEY_MAX + 1)).is_err());
    }

    #[tokio::test]
    async fn a_key_is_claimed_once_until_its_time_is_over() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("s.db")).await.unwrap();
        assert_eq!(
            store.claim_idempotency_key("k", "sb1", "h1").await.unwrap(),
            Claim::Fresh
        );
        assert_eq!(
            store.claim_idempotency_key("k", "sb2", "h2").await.unwrap(),
            Claim::Taken {
                sandbox_id: "sb1".into(),
                request_sha256: "h1".into()
            }
        );
        // 24 h later the key is free again.
        sqlx::query("UPDATE idempotency_keys SET created_at = created_at - $1")
            .bind(KEY_TTL_MS + 1)
            .execute(store.pool())
            .await
            .unwrap();
        assert_eq!(
            store.claim_idempotency_key("k", "sb3", "h3").await.unwrap(),
            Claim::Fresh
        );
        store.forget_idempotency_key("k").await.unwrap();
        assert_eq!(
            store.claim_idempotency_key("k", "sb4", "h4").await.unwrap(),
            Claim::Fresh
        );
    }
}
