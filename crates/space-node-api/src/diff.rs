//! What a diff of a sandbox's trees reports (decision 0011).

use serde::{Deserialize, Serialize};

/// What happened to one path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeKind {
    Added,
    Modified,
    Deleted,
}

/// One changed path. `path` is absolute inside the sandbox ("/etc/hosts"), decoded as lossy
/// UTF-8 (names are sandbox-controlled bytes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    pub path: String,
    pub kind: ChangeKind,
    pub is_dir: bool,
}
