//! Automatic snapshots of a sandbox (decision 0010): on a period while its files change,
//! after every foreground exec, and how many of them to keep.

use serde::{Deserialize, Serialize};

/// Largest `keep_last` accepted.
pub const MAX_KEEP_LAST: u32 = 1000;
/// Largest `every_secs` accepted (one year).
pub const MAX_EVERY_SECS: u64 = 365 * 24 * 3600;

fn yes() -> bool {
    true
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_true(b: &bool) -> bool {
    *b
}

/// `CreateSandbox.snapshot_policy`, the body of `PUT /v1/sandboxes/{id}/snapshot-policy`
/// (it replaces the whole policy) and `Sandbox.snapshot_policy`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotPolicy {
    /// Take an automatic snapshot every this many seconds, when the sandbox's files changed
    /// since its last snapshot (running sandboxes only). 1..=31536000; none = never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every_secs: Option<u64>,
    /// Take an automatic snapshot after every foreground exec (asynchronously).
    #[serde(default, skip_serializing_if = "is_false")]
    pub after_exec: bool,
    /// Keep only the newest K automatic snapshots (1..=1000); none = keep all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_last: Option<u32>,
    /// Retention never deletes labelled snapshots (default true). With false, labelled
    /// snapshots count towards `keep_last` too. Unlabelled snapshots taken through the
    /// API are never deleted by retention; the sandbox's head never is.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub keep_labelled: bool,
}

impl Default for SnapshotPolicy {
    fn default() -> Self {
        Self {
            every_secs: None,
            after_exec: false,
            keep_last: None,
            keep_labelled: true,
        }
    }
}

impl SnapshotPolicy {
    /// Whether the policy asks for nothing (no automatic snapshots, no retention).
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_unknown_fields() {
        let p: SnapshotPolicy = serde_json::from_str("{}").unwrap();
        assert!(p.is_empty() && p.keep_labelled);
        assert_eq!(serde_json::to_string(&p).unwrap(), "{}");
        let p: SnapshotPolicy = serde_json::from_str(
            r#"{"every_secs":5,"after_exec":true,"keep_last":2,"keep_labelled":false}"#,
        )
        .unwrap();
        assert_eq!(p.every_secs, Some(5));
        assert!(p.after_exec && !p.keep_labelled);
        assert!(serde_json::from_str::<SnapshotPolicy>(r#"{"bogus":1}"#).is_err());
    }
}
