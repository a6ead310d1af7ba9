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
    /// A modified small text file's unified diff (both sides regular files of at most
    /// [`TEXT_DIFF_MAX_FILE`] bytes of UTF-8 without NUL; the first
    /// [`TEXT_DIFFS_MAX`] such files of a diff).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_diff: Option<String>,
}

/// The largest file a diff shows the text changes of.
pub const TEXT_DIFF_MAX_FILE: u64 = 64 * 1024;
/// How many files of one diff get their text changes.
pub const TEXT_DIFFS_MAX: usize = 100;
