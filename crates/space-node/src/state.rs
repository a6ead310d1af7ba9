//! The node-side record of one sandbox, persisted as `sandboxes/<id>/sandbox.json`.

use serde::{Deserialize, Serialize};

use crate::api::SandboxSpec;
use crate::runtime::Launched;

/// Bumped when the record's shape changes incompatibly.
pub const RECORD_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub record_version: u32,
    pub spec: SandboxSpec,
    /// The template version the rootfs was snapshotted from (pinned).
    pub template_version: u32,
    pub uid_base: u32,
    pub uid_count: u32,
    /// Written as "namespace" or "microvm".
    pub runtime: crate::api::RuntimeKind,
    pub created_unix_ms: u64,
    /// The running init, when launched (meaningless after a host reboot; checked with
    /// `Runtime::alive`).
    pub launched: Option<Launched>,
    /// Its network slot while it has one (decision 0012); re-adopted after a node restart.
    #[serde(default)]
    pub slot: Option<crate::net::SlotInfo>,
    /// The name the runtime knows the sandbox by (its cgroups, its init), when it differs
    /// from the id: a sandbox taken from a warm pool keeps the name it was built under
    /// (decision 0013).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_name: Option<String>,
    /// A ready member of a warm pool, not yet handed out. Such records are destroyed when a
    /// node starts (nothing of a user is in them).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pool_member: bool,
    /// Made from a warm pool member.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pooled: bool,
    /// Its VM was restored from a template checkpoint at its last start (microvm).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub restored: bool,
}

impl SandboxRecord {
    /// The name of the sandbox in the runtime (cgroups, tracked init).
    pub fn runtime_name(&self) -> &str {
        self.runtime_name.as_deref().unwrap_or(&self.spec.id)
    }
}

pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Limits;

    #[test]
    fn record_roundtrips_through_json() {
        let r = SandboxRecord {
            record_version: RECORD_VERSION,
            spec: SandboxSpec {
                id: "abc".into(),
                template: "base".into(),
                limits: Limits::default(),
                env: vec![("A".into(), "1".into())],
                hostname: "abc".into(),
                network: Default::default(),
                secrets: vec![],
                runtime: None,
            },
            template_version: 3,
            uid_base: 1_000_065_536,
            uid_count: 65536,
            runtime: crate::api::RuntimeKind::Namespace,
            created_unix_ms: 1,
            launched: Some(Launched {
                init_pid: 42,
                start_time: 7,
            }),
            slot: None,
            runtime_name: Some("p1".into()),
            pool_member: false,
            pooled: true,
            restored: false,
        };
        let json = serde_json::to_string(&r).unwrap();
        let back: SandboxRecord = serde_json::from_str(&json).unwrap();
        assert_eq!(back, r);
    }
}
