//! Leases in the store (issue 14, decision 0036): which control-plane replica works on a
//! sandbox now, so that replicas sharing a database never run the same reconcile step, or a
//! step during another replica's move, at once. Taken under the sandbox's in-process lock,
//! so one replica never holds one lease twice. A lease lapses [`LEASE_TTL`] after its last
//! renewal: a replica that dies holding one stops nobody for long.

use std::time::Duration;

use crate::store::{Store, StoreError, now_ms};

/// How long a lease lasts without renewal.
pub const LEASE_TTL: Duration = Duration::from_secs(30);
/// How often a held lease is renewed.
const RENEW_EVERY: Duration = Duration::from_secs(10);

fn q(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { what, source }
}

impl Store {
    /// Takes (or renews) lease `name` for `holder` until `now + ttl`: false while another
    /// holder's lease has not lapsed.
    pub async fn try_lease(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let now = now_ms();
        let done = sqlx::query(
            "INSERT INTO leases (name, holder, expires_at) VALUES ($1, $2, $3) \
             ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, \
             expires_at = excluded.expires_at \
             WHERE leases.holder = $2 OR leases.expires_at < $4",
        )
        .bind(name)
        .bind(holder)
        .bind(now + ttl.as_millis() as i64)
        .bind(now)
        .execute(self.pool())
        .await
        .map_err(q("take lease"))?;
        Ok(done.rows_affected() == 1)
    }

    /// Gives lease `name` up, if `holder` still holds it.
    pub async fn release_lease(&self, name: &str, holder: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM leases WHERE name = $1 AND holder = $2")
            .bind(name)
            .bind(holder)
            .execute(self.pool())
            .await
            .map_err(q("release lease"))?;
        Ok(())
    }
}

/// This replica's leases.
#[derive(Debug)]
pub struct Leases {
    store: Store,
    /// This replica, as lease holders are named.
    holder: String,
}

/// A lease held: renewed in the background, released when dropped.
#[derive(Debug)]
pub struct LeaseGuard {
    store: Store,
    holder: String,
    name: String,
    renew: tokio::task::JoinHandle<()>,
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.renew.abort();
        let (store, holder, name) = (self.store.clone(), self.holder.clone(), self.name.clone());
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                if let Err(e) = store.release_lease(&name, &holder).await {
                    tracing::debug!(lease = name, error = %e, "release failed; it lapses");
                }
            });
        }
    }
}

impl Leases {
    pub fn new(store: Store) -> Self {
        let bits: u64 = rand::random();
        Self {
            store,
            holder: format!("replica-{bits:016x}"),
        }
    }

    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// Sandbox `id`'s lease, or None while another replica holds it. The caller holds the
    /// sandbox's in-process lock.
    pub async fn sandbox(&self, id: &str) -> Result<Option<LeaseGuard>, StoreError> {
        let name = format!("sandbox/{id}");
        if !self.store.try_lease(&name, &self.holder, LEASE_TTL).await? {
            return Ok(None);
        }
        let (store, holder, n) = (self.store.clone(), self.holder.clone(), name.clone());
        let renew = tokio::spawn(async move {
            loop {
                tokio::time::sleep(RENEW_EVERY).await;
                match store.try_lease(&n, &holder, LEASE_TTL).await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::warn!(lease = n, "lease taken over by another replica");
                        return;
                    }
                    Err(e) => tracing::warn!(lease = n, error = %e, "lease renewal failed"),
                }
            }
        });
        Ok(Some(LeaseGuard {
            store: self.store.clone(),
            holder: self.holder.clone(),
            name,
            renew,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_holder_at_a_time_until_release_or_lapse() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("s.db")).await.unwrap();
        let (a, b) = (Leases::new(store.clone()), Leases::new(store.clone()));
        assert_ne!(a.holder(), b.holder());
        let held = a.sandbox("sb1").await.unwrap().expect("free");
        assert!(b.sandbox("sb1").await.unwrap().is_none(), "two holders");
        // Others are free; the holder renews its own.
        assert!(b.sandbox("sb2").await.unwrap().is_some());
        assert!(
            store
                .try_lease("sandbox/sb1", a.holder(), LEASE_TTL)
                .await
                .unwrap()
        );
        drop(held);
        // Released by a task of its own: within a few tries.
        let mut free = false;
        for _ in 0..100 {
            if b.sandbox("sb1").await.unwrap().is_some() {
                free = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(free, "a released lease was not free");
        // A holder that died: its lease lapses.
        assert!(
            store
                .try_lease("sandbox/sb3", "dead", Duration::from_millis(1))
                .await
                .unwrap()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert!(a.sandbox("sb3").await.unwrap().is_some());
    }
}
