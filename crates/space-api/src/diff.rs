//! DTOs of `GET /v1/sandboxes/{id}/diff` (decision 0011).

use serde::{Deserialize, Serialize};

/// One changed path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiffEntry {
    /// Absolute path inside the sandbox, lossy UTF-8.
    pub path: String,
    /// `added`, `modified` or `deleted`.
    pub change: String,
    /// `dir` or `file` (anything that is not a directory).
    #[serde(rename = "type")]
    pub kind: String,
    /// A modified small text file's unified diff (decision 0058: the console shows it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_diff: Option<String>,
}

/// The answer of `GET /v1/sandboxes/{id}/diff`, sorted by path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiffList {
    pub changes: Vec<DiffEntry>,
}
