//! Leases in the store (issue 14, decisions 0036 and 0055): which control-plane replica works
//! on a sandbox now, so that replicas sharing a database never run the same reconcile step,
//! or a step during another replica's move, at once. A lease lapses [`LEASE_TTL`] after its
//! last renewal: a replica that dies holding one stops nobody for long.
//!
//! - A reconcile pass claims the leases of every sandbox it has a step for in one statement
//!   ([`Leases::sandboxes`]); on PostgreSQL a lease row that another replica's claim has
//!   locked is skipped (`FOR UPDATE SKIP LOCKED`), never waited on. Whatever one replica
//!   claimed, the others leave for their next pass: the work spreads over the replicas.
//! - Within a replica, leases are counted: a move (which holds one sandbox's lease for its
//!   whole length) and a pass that claimed the same sandbox share the one row, and it is
//!   deleted when the last of them lets go.
//! - One task per replica renews every lease it holds, in one statement per renewal.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::store::{Store, StoreError, now_ms};

/// How long a lease lasts without renewal.
pub const LEASE_TTL: Duration = Duration::from_secs(30);
/// How often a held lease is renewed.
const RENEW_EVERY: Duration = Duration::from_secs(10);

fn q(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { what, source }
}

/// One lease taken for `holder` until `until`: inserted, or taken over from itself or from a
/// holder whose lease lapsed before `now` (one row affected), else left (none).
fn take_one<'q>(
    name: &'q str,
    holder: &'q str,
    until: i64,
    now: i64,
) -> sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>> {
    sqlx::query(
        "INSERT INTO leases (name, holder, expires_at) VALUES ($1, $2, $3) \
         ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, \
         expires_at = excluded.expires_at \
         WHERE leases.holder = $2 OR leases.expires_at < $4",
    )
    .bind(name)
    .bind(holder)
    .bind(until)
    .bind(now)
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
        let done = take_one(name, holder, now + ttl.as_millis() as i64, now)
            .execute(self.pool())
            .await
            .map_err(q("take lease"))?;
        Ok(done.rows_affected() == 1)
    }

    /// Takes (or renews) every lease of `names` that is free, `holder`'s, or lapsed, until
    /// `now + ttl`, in one statement; returns those taken. On PostgreSQL a lease row another
    /// transaction holds locked is skipped, not waited on (`FOR UPDATE SKIP LOCKED`); SQLite
    /// has one writer at a time, and takes them in one transaction.
    pub async fn try_leases(
        &self,
        names: &[String],
        holder: &str,
        ttl: Duration,
    ) -> Result<Vec<String>, StoreError> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let now = now_ms();
        let until = now + ttl.as_millis() as i64;
        if self.is_sqlite() {
            let mut tx = self.pool().begin().await.map_err(q("take leases"))?;
            let mut taken = Vec::new();
            for name in names {
                let done = take_one(name, holder, until, now)
                    .execute(&mut *tx)
                    .await
                    .map_err(q("take leases"))?;
                if done.rows_affected() == 1 {
                    taken.push(name.clone());
                }
            }
            tx.commit().await.map_err(q("take leases"))?;
            return Ok(taken);
        }
        // Names are `kind/id` with ids of [a-z0-9]: a comma never occurs in one.
        debug_assert!(names.iter().all(|n| !n.contains(',')));
        let rows = sqlx::query(
            "WITH want AS (SELECT DISTINCT unnest(string_to_array($1::text, ',')) AS name), \
             taken AS (INSERT INTO leases (name, holder, expires_at) \
                 SELECT name, $2::text, $3::bigint FROM want \
                 ON CONFLICT (name) DO NOTHING RETURNING name), \
             renewed AS (UPDATE leases SET holder = $2::text, expires_at = $3::bigint \
                 WHERE name IN (SELECT l.name FROM leases l JOIN want w ON l.name = w.name \
                     WHERE l.holder = $2::text OR l.expires_at < $4::bigint \
                     FOR UPDATE OF l SKIP LOCKED) \
                 RETURNING name) \
             SELECT name FROM taken UNION SELECT name FROM renewed",
        )
        .bind(names.join(","))
        .bind(holder)
        .bind(until)
        .bind(now)
        .fetch_all(self.pool())
        .await
        .map_err(q("take leases"))?;
        rows.iter()
            .map(|r| sqlx::Row::try_get::<String, _>(r, "name").map_err(q("take leases")))
            .collect()
    }

    /// Runs `sql` (which has `holder` as $1 and `extra` as $2 and ends with `name IN (`) over
    /// `names` in chunks; returns the rows it touched.
    async fn for_names(
        &self,
        what: &'static str,
        sql: &str,
        holder: &str,
        extra: Option<i64>,
        names: &[String],
    ) -> Result<u64, StoreError> {
        let mut touched = 0;
        for chunk in names.chunks(500) {
            let first = if extra.is_some() { 3 } else { 2 };
            let list: Vec<String> = (first..first + chunk.len())
                .map(|i| format!("${i}"))
                .collect();
            let text = format!("{sql}{})", list.join(", "));
            let mut query = sqlx::query(&text).bind(holder);
            if let Some(v) = extra {
                query = query.bind(v);
            }
            for n in chunk {
                query = query.bind(n);
            }
            touched += query
                .execute(self.pool())
                .await
                .map_err(q(what))?
                .rows_affected();
        }
        Ok(touched)
    }

    /// Renews `holder`'s leases of `names` until `now + ttl`; returns how many it still held.
    pub async fn renew_leases(
        &self,
        names: &[String],
        holder: &str,
        ttl: Duration,
    ) -> Result<u64, StoreError> {
        let until = now_ms() + ttl.as_millis() as i64;
        self.for_names(
            "renew leases",
            "UPDATE leases SET expires_at = $2 WHERE holder = $1 AND name IN (",
            holder,
            Some(until),
            names,
        )
        .await
    }

    /// Gives up `holder`'s leases of `names`.
    pub async fn release_leases(&self, names: &[String], holder: &str) -> Result<(), StoreError> {
        self.for_names(
            "release leases",
            "DELETE FROM leases WHERE holder = $1 AND name IN (",
            holder,
            None,
            names,
        )
        .await
        .map(drop)
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
#[derive(Debug, Clone)]
pub struct Leases {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    store: Store,
    /// This replica, as lease holders are named.
    holder: String,
    /// The leases it holds, each with how many guards hold it. Every change to it and to the
    /// rows it mirrors is made under this lock, so a release never deletes a row that a
    /// claim has just taken again.
    held: tokio::sync::Mutex<HashMap<String, u32>>,
    renewing: std::sync::Once,
}

/// Leases held: renewed in the background while held, let go when dropped.
#[derive(Debug)]
pub struct LeaseGuard {
    inner: Arc<Inner>,
    names: Vec<String>,
    /// The sandboxes whose leases these are.
    sandboxes: HashSet<String>,
}

impl LeaseGuard {
    /// Whether it holds sandbox `id`'s lease.
    pub fn holds(&self, id: &str) -> bool {
        self.sandboxes.contains(id)
    }

    /// How many leases it holds.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if self.names.is_empty() {
            return;
        }
        let (inner, names) = (self.inner.clone(), std::mem::take(&mut self.names));
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let mut held = inner.held.lock().await;
                let mut free = Vec::new();
                for n in names {
                    if let Some(count) = held.get_mut(&n) {
                        *count -= 1;
                        if *count == 0 {
                            held.remove(&n);
                            free.push(n);
                        }
                    }
                }
                if let Err(e) = inner.store.release_leases(&free, &inner.holder).await {
                    tracing::debug!(leases = free.len(), error = %e, "release failed; they lapse");
                }
            });
        }
    }
}

fn sandbox_lease(id: &str) -> String {
    format!("sandbox/{id}")
}

impl Leases {
    pub fn new(store: Store) -> Self {
        let bits: u64 = rand::random();
        Self {
            inner: Arc::new(Inner {
                store,
                holder: format!("replica-{bits:016x}"),
                held: Default::default(),
                renewing: std::sync::Once::new(),
            }),
        }
    }

    pub fn holder(&self) -> &str {
        &self.inner.holder
    }

    /// Sandbox `id`'s lease, or None while another replica holds it.
    pub async fn sandbox(&self, id: &str) -> Result<Option<LeaseGuard>, StoreError> {
        let guard = self.sandboxes([id]).await?;
        Ok((!guard.is_empty()).then_some(guard))
    }

    /// The leases of every sandbox of `ids` that no other replica holds, taken at once
    /// ([`Store::try_leases`]); [`LeaseGuard::holds`] says which.
    pub async fn sandboxes<'a>(
        &self,
        ids: impl IntoIterator<Item = &'a str>,
    ) -> Result<LeaseGuard, StoreError> {
        self.start_renewing();
        let wanted: HashSet<&str> = ids.into_iter().collect();
        let mut held = self.inner.held.lock().await;
        let (mut names, others): (Vec<String>, Vec<String>) = wanted
            .iter()
            .map(|id| sandbox_lease(id))
            .partition(|n| held.contains_key(n));
        let taken = self
            .inner
            .store
            .try_leases(&others, &self.inner.holder, LEASE_TTL)
            .await?;
        names.extend(taken);
        for n in &names {
            *held.entry(n.clone()).or_default() += 1;
        }
        let sandboxes = names
            .iter()
            .filter_map(|n| n.strip_prefix("sandbox/").map(str::to_owned))
            .collect();
        Ok(LeaseGuard {
            inner: self.inner.clone(),
            names,
            sandboxes,
        })
    }

    /// Starts the task that renews every lease this replica holds, once; it ends with the
    /// last handle on these leases.
    fn start_renewing(&self) {
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        self.inner.renewing.call_once(|| {
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(RENEW_EVERY).await;
                    let Some(inner) = weak.upgrade() else { return };
                    // Under the lock: a release meanwhile would read as a lease lost.
                    let held = inner.held.lock().await;
                    let names: Vec<String> = held.keys().cloned().collect();
                    let renewed = inner
                        .store
                        .renew_leases(&names, &inner.holder, LEASE_TTL)
                        .await;
                    drop(held);
                    match renewed {
                        Ok(n) if (n as usize) < names.len() => tracing::warn!(
                            lost = names.len() - n as usize,
                            "leases taken over by another replica after they lapsed"
                        ),
                        Ok(_) => {}
                        Err(e) => tracing::warn!(error = %e, "lease renewal failed"),
                    }
                }
            });
        });
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

    /// Waits (a few tries) until `l` can take sandbox `id`'s lease.
    async fn eventually_free(l: &Leases, id: &str) -> bool {
        for _ in 0..100 {
            if l.sandbox(id).await.unwrap().is_some() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    #[tokio::test]
    async fn a_pass_claims_at_once_and_shares_a_lease_within_its_replica() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("s.db")).await.unwrap();
        let (a, b) = (Leases::new(store.clone()), Leases::new(store.clone()));
        let b_holds = b.sandbox("sb2").await.unwrap().expect("free");
        // One claim: what another replica holds is left out.
        let pass = a.sandboxes(["sb1", "sb2", "sb3", "sb1"]).await.unwrap();
        assert_eq!(pass.len(), 2);
        assert!(pass.holds("sb1") && pass.holds("sb3") && !pass.holds("sb2"));
        // A move through the same replica shares sb1's lease; its end does not free it.
        let moving = a
            .sandbox("sb1")
            .await
            .unwrap()
            .expect("its own replica's lease");
        drop(moving);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            b.sandbox("sb1").await.unwrap().is_none(),
            "freed under the pass"
        );
        // The pass's end frees both; the other replica's lease was never touched.
        drop(pass);
        assert!(eventually_free(&b, "sb1").await);
        assert!(eventually_free(&b, "sb3").await);
        assert!(a.sandbox("sb2").await.unwrap().is_none());
        drop(b_holds);
        assert!(eventually_free(&a, "sb2").await);
        assert!(a.sandboxes([]).await.unwrap().is_empty());
    }
}
