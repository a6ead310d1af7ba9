//! The only crate of space allowed `unsafe`. Each raw syscall is wrapped once: a `-1` return
//! becomes `io::Error::last_os_error()`, every file descriptor gets an owner (`OwnedFd`), and
//! every `unsafe` block carries a `// SAFETY:` comment listing its invariants.

pub mod btrfs;
pub mod guest;
pub mod jail;
pub mod loopdev;
pub mod mntns;
pub mod mount;
pub mod netif;
pub mod netns;
pub mod ns;
pub mod probe;
pub mod process;
