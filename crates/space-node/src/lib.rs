//! Node-local services: runtimes, btrfs storage, cgroups, templates, recovery.

pub mod api;
pub mod cgroup;
pub mod channel;
pub mod diff;
#[doc(hidden)]
pub mod fuzzing;
pub mod ids;
pub(crate) mod moves;
pub mod net;
pub mod node;
pub mod oci;
pub(crate) mod quota;
pub mod run_dir;
pub mod runtime;
pub mod state;
pub mod storage;
pub mod template;
pub mod warm;

pub use api::{
    Limits, NodeApi, NodeError, Phase, PoolConfig, PoolStatus, SandboxSpec, SandboxStatus,
    TemplateInfo, TemplateSource,
};
pub use node::{Node, NodeConfig, NodeParts};
