//! Isolation runtimes. Both produce the same thing: a running space-daemon reachable over one
//! byte stream (here: a unix socket on the host). Everything above works the same for both.

pub mod microvm;
pub mod namespace;

use std::path::{Path, PathBuf};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::api::Limits;

/// Everything a runtime needs to start one sandbox. Built by the node from the spec, the
/// storage layer and the id allocator.
#[derive(Debug, Clone)]
pub struct LaunchPlan {
    pub id: String,
    /// Host path of the sandbox's writable rootfs subvolume. Its files are owned by host
    /// uid/gid 0..65536 on disk; the runtime maps them to uid_base.. with an idmapped mount.
    pub rootfs: PathBuf,
    /// First host uid and gid of the sandbox's range; `id_count` ids are mapped from 0.
    pub uid_base: u32,
    pub id_count: u32,
    pub hostname: String,
    pub limits: Limits,
    /// Environment of space-daemon (and so the base of every process it starts).
    pub env: Vec<(String, String)>,
    /// Host path of the static space-daemon binary, bind-mounted read-only at
    /// `/.space/space-daemon` inside the sandbox and exec'd as its PID 1.
    pub daemon_binary: PathBuf,
    /// Host path where the runtime binds the guest channel's listening unix socket.
    pub channel_socket: PathBuf,
    /// Per-sandbox host directory for runtime state (outside the sandbox).
    pub run_dir: PathBuf,
    /// The sandbox's network slot (a node-owned network namespace) to start in; None: a
    /// fresh empty one (loopback only).
    pub netns: Option<SlotNetns>,
    /// microvm: the sandbox's ext4 disk image (a reflink copy of its template's), attached
    /// as the guest's /dev/vda. None for the namespace runtime (it uses `rootfs`).
    pub disk: Option<PathBuf>,
}

/// A network namespace the sandbox joins, and the node's own to come back to.
#[derive(Debug, Clone)]
pub struct SlotNetns {
    pub ns: std::sync::Arc<std::fs::File>,
    pub home: std::sync::Arc<std::fs::File>,
}

/// What identifies a started sandbox across node restarts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Launched {
    /// Host pid of the sandbox's init.
    pub init_pid: u32,
    /// The init's start time (field 22 of /proc/PID/stat), so a recycled pid is not mistaken
    /// for our init after a restart.
    pub start_time: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("failed to {step}: {source}")]
    Setup {
        step: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("sandbox init failed during {step}: {source}")]
    Child {
        step: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cgroup error at {path}: {source}")]
    Cgroup {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("guest did not become ready: {0}")]
    NotReady(String),
}

#[async_trait]
pub trait Runtime: Send + Sync {
    /// Which kind of runtime this is.
    fn kind(&self) -> crate::api::RuntimeKind;
    /// Where the sandbox's own servers are reached from the node's side of its network slot:
    /// the slot's loopback for a sandbox that shares the slot's namespace.
    fn service_address(&self) -> std::net::Ipv4Addr {
        std::net::Ipv4Addr::LOCALHOST
    }
    /// The node's resolver as processes inside the sandbox reach it, in a slot whose node
    /// side is `slot_gateway`: that gateway for a sandbox that shares the slot's namespace
    /// (the node's root table takes its port 53 to the node's DNS, decision 0059).
    fn dns_address(&self, slot_gateway: std::net::Ipv4Addr) -> std::net::Ipv4Addr {
        slot_gateway
    }
    /// The identity a new guest of sandbox `id` is given over the channel, in its first RPC
    /// (a fresh RNG seed, machine-id and clock), for a runtime whose guest has its own kernel
    /// and sets its own hostname; None: the runtime sets up the sandbox from the host
    /// ([`Runtime::personalize`]) and the channel's first RPC carries the environment only.
    fn guest_identity(&self, _id: &str) -> Option<space_proto::PersonalizeRequest> {
        None
    }
    /// Start the sandbox; returns once space-daemon runs and the channel socket is bound
    /// (the node then connects to it). On error, everything this call set up is undone.
    async fn launch(&self, plan: &LaunchPlan) -> Result<Launched, RuntimeError>;
    /// Kill every process of the sandbox and free its cgroups and socket. Idempotent; the
    /// rootfs is left alone (storage owns it).
    async fn destroy(&self, id: &str, launched: Option<&Launched>) -> Result<(), RuntimeError>;
    /// Whether `launched` still names a live init of this sandbox.
    fn alive(&self, launched: &Launched) -> bool;
    /// Memory in use by the sandbox (from its cgroup), when known.
    fn memory_bytes(&self, id: &str) -> Option<u64>;
    /// The page cache part of `memory_bytes`, when known.
    fn memory_cache_bytes(&self, _id: &str) -> Option<u64> {
        None
    }
    /// CPU time the sandbox has used so far, in microseconds (from its cgroup), when known.
    fn cpu_usage_usec(&self, _id: &str) -> Option<u64> {
        None
    }
    /// Freeze (pause) or thaw every process of the sandbox; returns once the kernel reports
    /// the state reached.
    async fn set_frozen(&self, id: &str, _frozen: bool) -> Result<(), RuntimeError> {
        Err(RuntimeError::Setup {
            step: "freeze a sandbox",
            source: std::io::Error::other(format!("{} cannot pause sandbox {id}", self.kind())),
        })
    }
    /// Whether the sandbox is frozen now (read from the kernel).
    fn is_frozen(&self, _id: &str) -> bool {
        false
    }
    /// The key of the checkpoints this runtime can restore for a sandbox with `limits`:
    /// checkpoints with equal keys are interchangeable. None: this runtime has none.
    fn checkpoint_key(&self, _limits: &Limits) -> Option<String> {
        None
    }
    /// Saves the running sandbox `id` (its processes and memory) into the directory `dir`;
    /// with `resume` it runs on after, else it stays stopped until destroyed or thawed.
    async fn checkpoint(&self, id: &str, _dir: &Path, _resume: bool) -> Result<(), RuntimeError> {
        Err(unsupported(self.kind(), "checkpoint", id))
    }
    /// Checks the checkpoint in `dir` (its files, sizes and checksums) without starting
    /// anything: a restore of it for a sandbox with `limits` would get that far.
    fn verify_checkpoint(&self, dir: &Path, _limits: &Limits) -> Result<(), RuntimeError> {
        Err(unsupported(
            self.kind(),
            "verify a checkpoint",
            &dir.display().to_string(),
        ))
    }
    /// Starts sandbox `plan` from the checkpoint in `dir` instead of booting it.
    async fn restore(&self, plan: &LaunchPlan, _dir: &Path) -> Result<Launched, RuntimeError> {
        Err(unsupported(self.kind(), "restore", &plan.id))
    }
    /// Hands a running sandbox (a warm pool's ready one) to its user: applies `limits` when
    /// given and sets its hostname, without restarting anything (decision 0013).
    async fn personalize(
        &self,
        id: &str,
        launched: &Launched,
        limits: Option<&Limits>,
        hostname: &str,
    ) -> Result<(), RuntimeError> {
        let _ = (launched, limits, hostname);
        Err(RuntimeError::Setup {
            step: "personalize a sandbox",
            source: std::io::Error::other(format!(
                "{} cannot personalize sandbox {id}",
                self.kind()
            )),
        })
    }
}

/// Refuses `limits` a sandbox of runtime `kind` cannot have, saying why; known from the kind
/// alone, so a create is told even on a node without that runtime.
pub(crate) fn check_limits(kind: crate::api::RuntimeKind, limits: &Limits) -> Result<(), String> {
    match kind {
        crate::api::RuntimeKind::Namespace => Ok(()),
        crate::api::RuntimeKind::Microvm => microvm::check_limits(limits),
    }
}

fn unsupported(kind: crate::api::RuntimeKind, what: &'static str, id: &str) -> RuntimeError {
    RuntimeError::Setup {
        step: what,
        source: std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            format!("the {kind} runtime cannot {what} sandbox {id}"),
        ),
    }
}
