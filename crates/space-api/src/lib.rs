//! space-api: the public DTOs of the space REST API v1 and an async Rust client.
//!
//! The types in [`types`] are pure data (serde); the wire contract is `api/openapi.yaml`.

pub mod b64;
pub mod client;
pub mod copy;
pub mod diff;
pub mod event;
pub mod net;
pub mod node;
pub mod pool;
pub mod snapshot;
pub mod snapshot_policy;
pub mod tenant;
pub mod types;

pub use client::{ByteStream, Client, ClientError, EventStream, ExecOutput};
pub use diff::*;
pub use event::*;
pub use net::*;
pub use node::{
    ClusterStatus, CreateJoinToken, Drain, JoinToken, MigrateRequest, Migration, Node, NodeList,
};
pub use pool::*;
/// Request bodies for uploads (`Body::wrap_stream` streams any byte stream).
pub use reqwest::Body;
pub use snapshot::*;
pub use snapshot_policy::*;
pub use types::*;
