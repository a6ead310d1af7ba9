//! Warm pools: ready sandboxes kept per template so that a create only personalizes one
//! (decision 0013).

use serde::{Deserialize, Serialize};

/// `PUT /v1/templates/{name}/pool`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetPool {
    /// Ready sandboxes kept at all times (0 turns the pool off).
    pub min: u32,
    /// How far the pool may grow while creates outrun it (default: `min`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<u32>,
    /// The runtime whose sandboxes are pooled (default: the node's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
}

/// A template's warm pool: its configuration and what the node observes now.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pool {
    pub template: String,
    pub runtime: String,
    /// Configured sizes, after clamping to the node's capacity.
    pub min: u32,
    pub max: u32,
    /// What the pool refills to now: `min`, raised toward `max` after misses.
    pub target: u32,
    /// Sandboxes ready to be handed out.
    pub ready: u32,
    /// Sandboxes being built for the pool now.
    pub starting: u32,
    /// Creates served from the pool, and creates that found it empty (since spaced started).
    pub hits: u64,
    pub misses: u64,
    /// Why the requested sizes were clamped, when they were.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolList {
    pub pools: Vec<Pool>,
}
