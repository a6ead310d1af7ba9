//! A sandbox's resource usage over time (decision 0024): one task samples the cgroup counters
//! of every running sandbox every `NodeConfig::usage_interval` and keeps the last
//! [`HISTORY`] samples per sandbox in memory. The control plane turns them into CPU
//! percentages and memory figures (`GET /v1/sandboxes/{id}/metrics`, E2B's metrics). Lost
//! on restart, like E2B's: it is a window for dashboards, not an account.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::Node;
use crate::api::{NodeApi, NodeError, SandboxUsage, UsageSample};
use crate::state::now_unix_ms;

/// Samples kept per sandbox: 30 minutes at the default 5 s (32 bytes each).
pub const HISTORY: usize = 360;

/// The samples of every sandbox the node sampled, oldest first.
#[derive(Debug, Default)]
pub(crate) struct UsageHistory {
    by_id: Mutex<HashMap<String, VecDeque<UsageSample>>>,
}

impl UsageHistory {
    fn record(&self, id: &str, sample: UsageSample) {
        let mut map = self.by_id.lock().unwrap_or_else(|e| e.into_inner());
        let ring = map.entry(id.to_owned()).or_default();
        if ring.len() == HISTORY {
            ring.pop_front();
        }
        ring.push_back(sample);
    }

    fn samples(&self, id: &str) -> Vec<UsageSample> {
        let map = self.by_id.lock().unwrap_or_else(|e| e.into_inner());
        map.get(id)
            .map(|r| r.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Forgets every sandbox not in `live`.
    fn retain(&self, live: &HashSet<String>) {
        let mut map = self.by_id.lock().unwrap_or_else(|e| e.into_inner());
        map.retain(|id, _| live.contains(id));
    }
}

impl Node {
    /// The sandbox's counters now, when its cgroups answer (a stopped sandbox has none).
    fn usage_now(&self, runtime: crate::api::RuntimeKind, name: &str) -> Option<UsageSample> {
        let rt = self.rt_of(runtime);
        Some(UsageSample {
            unix_ms: now_unix_ms(),
            cpu_usage_usec: rt.cpu_usage_usec(name)?,
            memory_bytes: rt.memory_bytes(name)?,
            memory_cache_bytes: rt.memory_cache_bytes(name).unwrap_or(0),
        })
    }

    /// Takes one sample of every sandbox (pool members are nobody's yet).
    fn sample_usage(&self) {
        let sandboxes: Vec<(String, crate::api::RuntimeKind, String)> = self
            .table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|e| &e.record)
            .filter(|r| !r.pool_member)
            .map(|r| {
                let name = r.runtime_name().to_owned();
                (r.spec.id.clone(), r.runtime, name)
            })
            .collect();
        let mut live = HashSet::with_capacity(sandboxes.len());
        for (id, runtime, name) in sandboxes {
            if let Some(s) = self.usage_now(runtime, &name) {
                self.usage.record(&id, s);
            }
            live.insert(id);
        }
        self.usage.retain(&live);
    }

    /// Starts the sampling task (none when the interval is zero).
    pub(super) fn start_usage_sampler(self: &Arc<Self>) {
        let every = self.cfg.usage_interval;
        if !every.is_zero() {
            tokio::spawn(usage_loop(Arc::downgrade(self), every));
        }
    }

    /// The sandbox's samples, a fresh one last, and its disk as the guest sees it.
    pub(super) async fn sandbox_usage_impl(&self, id: &str) -> Result<SandboxUsage, NodeError> {
        crate::ids::validate_sandbox_id(id)?;
        let rec = self
            .entry(id)
            .ok_or_else(|| NodeError::NotFound {
                kind: "sandbox",
                id: id.to_owned(),
            })?
            .record;
        let mut samples = self.usage.samples(id);
        let mut usage = SandboxUsage::default();
        if let Some(now) = self.usage_now(rec.runtime, rec.runtime_name()) {
            samples.push(now);
            // A paused guest does not answer; its disk is then unknown.
            if let Ok(mut guest) = NodeApi::guest(self, id).await {
                let info = tokio::time::timeout(
                    Duration::from_secs(2),
                    guest.info(space_proto::InfoRequest {}),
                )
                .await;
                if let Ok(Ok(r)) = info {
                    let r = r.into_inner();
                    usage.disk_total_bytes = Some(r.disk_total_bytes);
                    usage.disk_used_bytes = Some(r.disk_used_bytes);
                }
            }
        }
        usage.samples = samples;
        Ok(usage)
    }
}

async fn usage_loop(weak: Weak<Node>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(node) = weak.upgrade() else {
            return;
        };
        // Cgroup files are read synchronously: off the async workers.
        let _ = tokio::task::spawn_blocking(move || node.sample_usage()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(unix_ms: u64) -> UsageSample {
        UsageSample {
            unix_ms,
            cpu_usage_usec: unix_ms,
            memory_bytes: 1,
            memory_cache_bytes: 0,
        }
    }

    #[test]
    fn history_keeps_the_newest_and_forgets_the_gone() {
        let h = UsageHistory::default();
        for t in 0..(HISTORY as u64 + 5) {
            h.record("a", at(t));
        }
        h.record("b", at(1));
        let a = h.samples("a");
        assert_eq!(a.len(), HISTORY);
        assert_eq!(a[0].unix_ms, 5);
        assert_eq!(a.last().unwrap().unix_ms, HISTORY as u64 + 4);
        h.retain(&HashSet::from(["b".to_owned()]));
        assert!(h.samples("a").is_empty());
        assert_eq!(h.samples("b").len(), 1);
        assert!(h.samples("nope").is_empty());
    }
}
