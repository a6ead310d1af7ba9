//! The guest-channel protocol: one gRPC service (`space.guest.v1.Guest`) that space-daemon
//! serves on the single channel of each sandbox, generated from `proto/guest.proto`; and in
//! [`node`], the node contract's transport between control plane and node agents
//! (`space.node.v1.Node`, `proto/node.proto`).

#![allow(clippy::all, missing_docs)]

pub mod guest {
    tonic::include_proto!("space.guest.v1");
}

pub use guest::*;

pub mod node {
    tonic::include_proto!("space.node.v1");
}

/// The protocol version the daemon reports in `InfoReply.version`.
pub const PROTOCOL_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Largest single gRPC message either side accepts (file chunks are far smaller).
pub const MAX_MESSAGE_BYTES: usize = 8 * 1024 * 1024;

/// Size of the chunks files and output are streamed in.
pub const CHUNK_BYTES: usize = 256 * 1024;

/// The daemon-only variable of a sandbox's base environment that names its template's default
/// user: exec and file operations that name no user run as it (root when it is absent).
pub const DEFAULT_USER_ENV: &str = "SPACE_DEFAULT_USER";

/// The daemon-only variable that names the working directory of execs that name none (an OCI
/// image's WorkingDir); absent, they start in the user's home.
pub const DEFAULT_CWD_ENV: &str = "SPACE_DEFAULT_CWD";

/// A microvm guest's link (decision 0014, "Networking"): the same in every VM, so a
/// checkpoint's network configuration is valid in every copy restored from it. The node's
/// side of the tap, inside the sandbox's network slot, is the gateway; the slot NATs the
/// guest to the slot's own address, which is the sandbox's address to the outside.
pub mod vm_link {
    use std::net::Ipv4Addr;

    /// The guest's interface (virtio-net).
    pub const GUEST_IFNAME: &str = "eth0";
    /// The guest's address on its link.
    pub const GUEST: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 2);
    /// The node's end of the link (the tap in the slot): the guest's default route and
    /// resolver.
    pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 1);
    pub const PREFIX: u8 = 30;
    /// The tap device's name inside the slot.
    pub const TAP: &str = "tap0";
}

/// What a microvm guest's init says (in its fatal console line) when the kernel has no timer
/// interrupt: it disabled the LAPIC timer after a boot-time calibration that measured it
/// "too slow" (seen under TCG on a starved host). Nothing would ever tick in that guest, so
/// its init refuses to go on and the node boots the VM again (decision 0014, "Readiness").
pub const GUEST_NO_TIMER: &str = "no local timer interrupts since boot";

/// Test support for the crates whose fuzz entries live beside their code (docs/FUZZING.md).
#[doc(hidden)]
pub mod fuzz_corpus {
    use std::path::PathBuf;

    /// `fuzz/corpus/<target>` of this repository.
    pub fn dir(target: &str) -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/corpus")).join(target)
    }

    /// Runs every input of the target's committed corpus through `run` (a panic names the
    /// input); returns how many there were.
    pub fn replay(target: &str, run: impl Fn(&[u8])) -> usize {
        let dir = dir(target);
        let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("a corpus entry").path())
            .collect();
        paths.sort();
        for path in &paths {
            let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&data)));
            if ran.is_err() {
                panic!("fuzz input {} panicked", path.display());
            }
        }
        paths.len()
    }
}
