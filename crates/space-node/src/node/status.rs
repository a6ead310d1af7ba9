//! What the node reports of its sandboxes: each one's status, read from its runtime.

use crate::api::{Phase, SandboxStatus};

use super::Node;
use crate::state::SandboxRecord;

impl Node {
    pub(super) fn is_running(&self, rec: &SandboxRecord) -> bool {
        rec.launched.as_ref().is_some_and(|l| self.rt(rec).alive(l))
    }

    pub(super) fn status_of(&self, rec: &SandboxRecord) -> SandboxStatus {
        self.status_with(rec, true)
    }

    /// The sandbox's status; without `usage`, its memory, CPU and disk figures are not read
    /// (`NodeApi::observe_phases`).
    fn status_with(&self, rec: &SandboxRecord, usage: bool) -> SandboxStatus {
        let running = self.is_running(rec);
        let measured = running && usage;
        SandboxStatus {
            id: rec.spec.id.clone(),
            phase: if !running {
                Phase::Stopped
            } else if self.rt(rec).is_frozen(rec.runtime_name()) {
                Phase::Paused
            } else {
                Phase::Running
            },
            template: rec.spec.template.clone(),
            runtime: rec.runtime,
            init_pid: if running {
                rec.launched.as_ref().map(|l| l.init_pid)
            } else {
                None
            },
            uid_base: rec.uid_base,
            uid_count: rec.uid_count,
            channel: self.layout.channel_socket(rec.runtime_name()),
            memory_bytes: if measured {
                self.rt(rec).memory_bytes(rec.runtime_name())
            } else {
                None
            },
            cpu_usage_usec: if measured {
                self.rt(rec).cpu_usage_usec(rec.runtime_name())
            } else {
                None
            },
            disk_bytes: rec.spec.limits.disk_mib.filter(|_| usage).and_then(|_| {
                crate::quota::usage(&self.layout, self.subvols.as_ref(), &rec.spec.id)
            }),
            network: self.network.as_ref().and_then(|n| n.status(&rec.spec.id)),
            pooled: rec.pooled,
            restored: rec.restored,
        }
    }

    /// Every sandbox's status, sorted by id (see [`Node::status_with`]).
    pub(super) fn statuses(&self, usage: bool) -> Vec<SandboxStatus> {
        let records: Vec<SandboxRecord> = self
            .table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|e| e.record.clone())
            .collect();
        let mut out: Vec<_> = records.iter().map(|r| self.status_with(r, usage)).collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }
}
