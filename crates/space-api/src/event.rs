//! Events and audit records (decision 0009): `GET /v1/sandboxes/{id}/events`.

use serde::{Deserialize, Serialize};

/// One thing the platform did to a sandbox, or that happened to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Increasing over time; pass the last one seen as `after` to page.
    pub id: i64,
    /// Unix milliseconds.
    pub time: i64,
    /// `api:<key id>`, `reconciler` or `node`.
    pub actor: String,
    pub sandbox_id: String,
    /// e.g. `create`, `exec`, `file_write`, `running`, `recovered`.
    pub action: String,
    /// `ok` or an error code.
    pub result: String,
    /// Short and free of file contents, env values and secrets.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventList {
    pub events: Vec<Event>,
}

/// Query of `GET /v1/sandboxes/{id}/events`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventQuery {
    /// At most this many (default 100, at most 1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    /// Only events with a larger id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<i64>,
}
