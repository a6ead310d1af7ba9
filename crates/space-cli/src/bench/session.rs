//! What one bench run holds: the client, the sandboxes it made (all deleted at the end, also
//! after a failure or Ctrl-C) and the template's pool configuration before the run (restored
//! at the end).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use space_api::{Client, CreateSandbox, ExecRequest, Pool, Sandbox, SetPool};

/// Deletes in flight at once during cleanup.
const DELETE_CONCURRENCY: usize = 16;
/// Creates in flight at once while [`Session::fill`] fills the node.
pub const FILL_CONCURRENCY: usize = 8;

#[derive(Debug, Clone)]
enum SavedPool {
    /// The template had no pool.
    None,
    Some {
        min: u32,
        max: u32,
        runtime: String,
    },
}

#[derive(Clone)]
pub struct Session {
    pub c: Client,
    pub template: String,
    created: Arc<Mutex<BTreeSet<String>>>,
    saved_pool: Arc<Mutex<Option<SavedPool>>>,
}

impl Session {
    pub fn new(c: Client, template: &str) -> Self {
        Self {
            c,
            template: template.to_string(),
            created: Arc::default(),
            saved_pool: Arc::default(),
        }
    }

    fn lock_created(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        self.created.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Remembers a sandbox to delete at cleanup.
    pub fn track(&self, id: &str) {
        self.lock_created().insert(id.to_string());
    }

    /// Forgets a sandbox deleted already.
    pub fn untrack(&self, id: &str) {
        self.lock_created().remove(id);
    }

    /// Creates a sandbox of the template and tracks it.
    pub async fn create(&self) -> Result<Sandbox> {
        let sb = self
            .c
            .create_sandbox(&CreateSandbox {
                template: Some(self.template.clone()),
                ..Default::default()
            })
            .await?;
        self.track(&sb.id);
        Ok(sb)
    }

    /// Creates `n` idle sandboxes, [`FILL_CONCURRENCY`] at a time, with progress on stderr
    /// every 2 s (labelled `what`); their ids in the order the creates finished.
    pub async fn fill(&self, n: usize, what: &str) -> Result<Vec<String>> {
        let mut last = Instant::now();
        let mut made = Vec::with_capacity(n);
        let mut creates = futures::stream::iter(0..n)
            .map(|_| self.create())
            .buffer_unordered(FILL_CONCURRENCY);
        while let Some(r) = creates.next().await {
            made.push(
                r.with_context(|| format!("{what}: create #{} failed", made.len() + 1))?
                    .id,
            );
            if last.elapsed() >= Duration::from_secs(2) {
                eprintln!("space bench: {what}: {}/{n} sandboxes", made.len());
                last = Instant::now();
            }
        }
        Ok(made)
    }

    /// Runs `true` in the sandbox and checks it exited 0.
    pub async fn exec_true(&self, id: &str) -> Result<()> {
        let out = self.c.exec_output(id, &ExecRequest::new(["true"])).await?;
        if out.status() != 0 {
            bail!("`true` exited with {} in sandbox {id}", out.status());
        }
        Ok(())
    }

    /// Deletes every tracked sandbox, `DELETE_CONCURRENCY` at a time, with progress on stderr
    /// for large sets. Failures are reported, not returned.
    pub async fn cleanup(&self) {
        let ids: Vec<String> = std::mem::take(&mut *self.lock_created())
            .into_iter()
            .collect();
        if ids.is_empty() {
            return;
        }
        let total = ids.len();
        let started = Instant::now();
        let mut last = Instant::now();
        let mut done = 0usize;
        let mut failed = 0usize;
        let mut results = futures::stream::iter(ids)
            .map(|id| {
                let c = self.c.clone();
                async move { (c.delete_sandbox(&id).await, id) }
            })
            .buffer_unordered(DELETE_CONCURRENCY);
        while let Some((r, id)) = results.next().await {
            done += 1;
            if let Err(e) = r
                && e.status() != Some(404)
            {
                failed += 1;
                eprintln!("space bench: cannot delete {id}: {e}");
            }
            if total >= 50 && last.elapsed() >= Duration::from_secs(1) {
                eprintln!("space bench: deleting sandboxes {done}/{total}");
                last = Instant::now();
            }
        }
        if total >= 50 {
            eprintln!(
                "space bench: deleted {}/{total} sandboxes in {:.1} s",
                total - failed,
                started.elapsed().as_secs_f64()
            );
        }
    }

    /// Sets the template's pool, remembering the configuration before the first change.
    pub async fn set_pool(&self, min: u32, max: u32) -> Result<Pool> {
        self.set_pool_of(min, max, None).await
    }

    /// [`Session::set_pool`] for the sandboxes of `runtime` (None: the node's default).
    pub async fn set_pool_of(&self, min: u32, max: u32, runtime: Option<&str>) -> Result<Pool> {
        let saved = self
            .saved_pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if saved.is_none() {
            let prev = match self.c.get_pool(&self.template).await {
                Ok(p) => SavedPool::Some {
                    min: p.min,
                    max: p.max,
                    runtime: p.runtime,
                },
                // No pool for this template (an unknown template fails on the set below).
                Err(e) if e.status() == Some(404) => SavedPool::None,
                Err(e) => {
                    return Err(e).with_context(|| {
                        format!("cannot read the pool of template {}", self.template)
                    });
                }
            };
            *self.saved_pool.lock().unwrap_or_else(|e| e.into_inner()) = Some(prev);
        }
        let req = SetPool {
            min,
            max: Some(max),
            runtime: runtime.map(str::to_owned),
        };
        self.c
            .set_pool(&self.template, &req)
            .await
            .with_context(|| format!("cannot set the pool of template {}", self.template))
    }

    /// Puts the template's pool back as it was before the run (if the run changed it).
    pub async fn restore_pool(&self) {
        let saved = self
            .saved_pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let (min, max, runtime) = match saved {
            None => return,
            Some(SavedPool::None) => (0, 0, None),
            Some(SavedPool::Some { min, max, runtime }) => (min, max, Some(runtime)),
        };
        let req = SetPool {
            min,
            max: Some(max),
            runtime,
        };
        if let Err(e) = self.c.set_pool(&self.template, &req).await {
            eprintln!(
                "space bench: cannot restore the pool of template {} to min {min} max {max}: {e}",
                self.template
            );
        }
    }

    /// Waits until the pool holds `want` ready sandboxes, or `limit` passes; progress on
    /// stderr. Returns the last observed pool.
    pub async fn wait_pool_ready(&self, want: u32, limit: Duration) -> Result<(Pool, Duration)> {
        let t0 = Instant::now();
        let mut last_print = Instant::now();
        loop {
            let p = self.c.get_pool(&self.template).await?;
            if p.ready >= want || t0.elapsed() >= limit {
                if want > 0 {
                    eprintln!(
                        "space bench: pool of {}: {} ready of {want} after {:.1} s",
                        self.template,
                        p.ready,
                        t0.elapsed().as_secs_f64()
                    );
                }
                return Ok((p, t0.elapsed()));
            }
            if last_print.elapsed() >= Duration::from_secs(2) {
                eprintln!(
                    "space bench: warming the pool of {}: {} ready, {} starting, want {want}",
                    self.template, p.ready, p.starting
                );
                last_print = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits (bounded) until the pool has stopped building (refilled to its target), so that
    /// a measurement that follows does not share the CPU with the refill. No pool: returns.
    pub async fn wait_pool_idle(&self, limit: Duration) {
        let t0 = Instant::now();
        while t0.elapsed() < limit {
            match self.c.get_pool(&self.template).await {
                Ok(p) if p.starting > 0 || p.ready < p.target => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                _ => return,
            }
        }
        eprintln!("space bench: the pool was still refilling after {limit:?}; measuring anyway");
    }

    /// Runs `body`, then always deletes what the run created and restores the pool, also when
    /// `body` fails or the user presses Ctrl-C (best effort: a create in flight at that
    /// moment is not known to the bench).
    pub async fn guarded<T>(&self, body: impl Future<Output = Result<T>>) -> Result<T> {
        let r = tokio::select! {
            r = body => r,
            _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
        };
        self.cleanup().await;
        self.restore_pool().await;
        r
    }
}

/// How long to wait for `want` pool sandboxes: 120 s, or longer for big pools at the node's
/// ~50 sandboxes/s refill rate, at most 600 s.
pub fn pool_wait_limit(want: usize) -> Duration {
    Duration::from_secs((want as u64 / 25).clamp(120, 600))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_wait_is_bounded() {
        assert_eq!(pool_wait_limit(10), Duration::from_secs(120));
        assert_eq!(pool_wait_limit(5000), Duration::from_secs(200));
        assert_eq!(pool_wait_limit(1_000_000), Duration::from_secs(600));
    }
}
