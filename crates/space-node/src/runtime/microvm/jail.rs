//! The QEMU jail (issue 6): each QEMU runs as its sandbox's own unprivileged uid/gid
//! (`LaunchPlan::uid_base`), in a mount namespace whose root is a tmpfs holding only its
//! files, with `no_new_privs` and QEMU's seccomp sandbox, inside a per-sandbox cgroup with
//! the sandbox's cpu/memory/pids limits. The raw part (namespaces, mounts, pivot, dropping
//! privileges) is `space_sys::jail`; this module decides what goes into the jail.
//!
//! What the jail holds, each at its host path (so QEMU's command line and the node's view of
//! the sockets stay the same):
//! - `/usr` read-only (QEMU is dynamically linked; its libraries, modules and firmware such
//!   as `qboot.rom` live under /usr), and `/lib`, `/lib64`, `/bin`, `/sbin` as the same
//!   symlinks (merged /usr) or read-only binds; `/etc/ld.so.cache` read-only. Binding /usr
//!   whole rather than the ~40 files `ldd` lists keeps the jail right across QEMU upgrades
//!   and module loading; /usr holds no secrets, and it is read-only, nosuid, nodev.
//! - the QEMU binary itself when it lives outside /usr;
//! - the guest kernel and the initramfs, read-only (unless already visible under /usr);
//! - the sandbox's disk image, read-write;
//! - the sandbox's run dir, read-write (channel socket, QMP socket, console log);
//! - `/dev/null`, `/dev/urandom`, and `/dev/kvm` under KVM.
//!
//! QEMU runs inside the sandbox's network slot (or, without one, a fresh empty namespace),
//! holding only its tap device (an inherited descriptor; no `/dev/net/tun` in the jail): it
//! can reach what the guest can, under the slot's policy, and nothing of the node's network.
//!
//! No /proc, no /sys, no /etc beyond the loader cache, no pid namespace (the node tracks QEMU
//! by its host pid and start time).

use std::collections::HashSet;
use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use space_sys::jail::{BindMode, JailOp};

use super::qemu::{AccelKind, VmSpec};
use crate::api::Limits;

/// Memory QEMU may use beyond the guest's RAM (its own heap, device state, page tables).
pub const OVERHEAD_MIB: u64 = 128;
/// Under TCG, the translation cache QEMU is given (`-accel tcg,tb-size=`), also charged.
pub const TCG_TB_MIB: u64 = 64;
/// Tasks in a QEMU's cgroup: main loop, RCU, vCPUs, and up to 64 block I/O workers.
pub const QEMU_PIDS: u32 = 128;
/// The default cgroup parent of the QEMU cgroups (`<root>/<controller>/space-vm/<id>`).
pub const DEFAULT_CGROUP_PARENT: &str = "space-vm";

/// Top-level entries of a merged-/usr (or not) root that the dynamic loader may go through.
const ROOT_LINKS: [&str; 5] = ["/lib", "/lib64", "/lib32", "/bin", "/sbin"];

/// Limits of the QEMU cgroup for a guest of `memory_mib` under `accel` with the sandbox's
/// CPU quota.
pub fn cgroup_limits(sandbox: &Limits, memory_mib: u64, accel: AccelKind) -> Limits {
    let tb = if accel == AccelKind::Tcg {
        TCG_TB_MIB
    } else {
        0
    };
    Limits {
        cpu_millis: sandbox.cpu_millis,
        memory_mib: memory_mib + OVERHEAD_MIB + tb,
        pids: QEMU_PIDS,
        rlimits: Default::default(),
        disk_mib: None,
    }
}

/// Collects the ops, creating every parent directory once.
#[derive(Debug, Default)]
struct Builder {
    ops: Vec<JailOp>,
    dirs: HashSet<PathBuf>,
    /// Read-only trees already bound (a file under one needs no bind of its own).
    covered: Vec<PathBuf>,
}

impl Builder {
    fn mkdirs(&mut self, dir: &Path) {
        let mut chain: Vec<&Path> = dir.ancestors().filter(|a| *a != Path::new("/")).collect();
        chain.reverse();
        for d in chain {
            if self.dirs.insert(d.to_path_buf()) {
                self.ops.push(JailOp::Mkdir(d.to_path_buf()));
            }
        }
    }

    fn is_covered(&self, p: &Path) -> bool {
        self.covered.iter().any(|c| p.starts_with(c))
    }

    fn bind(&mut self, path: &Path, mode: BindMode, is_dir: bool) {
        if matches!(mode, BindMode::ReadOnly | BindMode::ReadOnlyExec) && self.is_covered(path) {
            return;
        }
        if is_dir {
            self.mkdirs(path);
        } else {
            if let Some(parent) = path.parent() {
                self.mkdirs(parent);
            }
            self.ops.push(JailOp::Touch(path.to_path_buf()));
        }
        self.ops.push(JailOp::Bind {
            src: path.to_path_buf(),
            dst: path.to_path_buf(),
            mode,
        });
        if is_dir && matches!(mode, BindMode::ReadOnly | BindMode::ReadOnlyExec) {
            self.covered.push(path.to_path_buf());
        }
    }
}

fn canonical(p: &Path) -> io::Result<PathBuf> {
    fs::canonicalize(p).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("cannot resolve {} for the jail: {e}", p.display()),
        )
    })
}

/// The jail's contents for `spec`, with QEMU at `qemu` (canonical) and the run dir `run_dir`.
/// Every host path is canonicalized so that a bind never follows a symlink the guest side
/// could change. Err: a path that does not exist.
#[cfg(test)]
pub fn ops(qemu: &Path, spec: &VmSpec, run_dir: &Path) -> io::Result<Vec<JailOp>> {
    ops_with(qemu, spec, run_dir, None)
}

/// [`ops`], plus the guest's memory file (file-backed RAM) bound read-write at its path.
pub fn ops_with(
    qemu: &Path,
    spec: &VmSpec,
    run_dir: &Path,
    memory_file: Option<&Path>,
) -> io::Result<Vec<JailOp>> {
    let mut b = Builder::default();
    b.bind(Path::new("/usr"), BindMode::ReadOnlyExec, true);
    for l in ROOT_LINKS {
        let p = Path::new(l);
        match fs::symlink_metadata(p) {
            Ok(m) if m.file_type().is_symlink() => {
                let target = fs::read_link(p)?;
                b.ops.push(JailOp::Symlink {
                    target,
                    link: p.to_path_buf(),
                });
            }
            Ok(m) if m.is_dir() => b.bind(p, BindMode::ReadOnlyExec, true),
            _ => {}
        }
    }
    let ld_cache = Path::new("/etc/ld.so.cache");
    if ld_cache.is_file() {
        b.bind(ld_cache, BindMode::ReadOnly, false);
    }
    b.bind(qemu, BindMode::ReadOnlyExec, false);
    b.bind(&canonical(&spec.kernel)?, BindMode::ReadOnly, false);
    b.bind(&canonical(&spec.initrd)?, BindMode::ReadOnly, false);
    // The disk and the run dir keep the paths QEMU's command line names (the node made them;
    // they are not symlinks).
    b.bind(&spec.disk, BindMode::ReadWrite, false);
    b.bind(run_dir, BindMode::ReadWrite, true);
    if let Some(m) = memory_file {
        // The file alone, not its directory: other VMs' memory files live next to it.
        b.bind(m, BindMode::ReadWrite, false);
    }
    b.bind(Path::new("/dev/null"), BindMode::Device, false);
    b.bind(Path::new("/dev/urandom"), BindMode::Device, false);
    if spec.accel == AccelKind::Kvm {
        b.bind(Path::new("/dev/kvm"), BindMode::Device, false);
    }
    Ok(b.ops)
}

/// Supplementary groups for QEMU: the group owning /dev/kvm under KVM (unless it is root's:
/// QEMU never gets group 0), else none.
pub fn groups(accel: AccelKind) -> Vec<u32> {
    if accel != AccelKind::Kvm {
        return Vec::new();
    }
    match fs::metadata("/dev/kvm") {
        Ok(m) if m.gid() != 0 => vec![m.gid()],
        _ => Vec::new(),
    }
}

/// Opens every `cgroup.procs` of a sandbox's QEMU cgroup for writing (before the fork).
pub fn open_procs(dirs: &[PathBuf]) -> io::Result<Vec<OwnedFd>> {
    dirs.iter()
        .map(|d| {
            let p = d.join("cgroup.procs");
            fs::OpenOptions::new()
                .write(true)
                .open(&p)
                .map(OwnedFd::from)
                .map_err(|e| io::Error::new(e.kind(), format!("cannot open {}: {e}", p.display())))
        })
        .collect()
}

/// Gives the jailed QEMU its files: the run dir and the disk image become `uid:gid`'s.
pub fn chown_files(uid: u32, gid: u32, paths: &[&Path]) -> io::Result<()> {
    for p in paths {
        std::os::unix::fs::chown(p, Some(uid), Some(gid))
            .map_err(|e| io::Error::new(e.kind(), format!("cannot chown {}: {e}", p.display())))?;
    }
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A VM spec of fixed paths, for command-line and jail tests.
    pub(in crate::runtime::microvm) fn spec(accel: AccelKind) -> VmSpec {
        VmSpec {
            kernel: "/proc/self/exe".into(),
            initrd: "/proc/self/exe".into(),
            accel,
            memory_mib: 256,
            vcpus: 1,
            disk: "/var/lib/space/sandboxes/abc/disk.ext4".into(),
            channel_socket: "/run/space/sandboxes/abc/guest.sock".into(),
            console: "/run/space/sandboxes/abc/console.log".into(),
            console_socket: "/run/space/sandboxes/abc/console.sock".into(),
            qmp: "/run/space/sandboxes/abc/qmp.sock".into(),
            mac: [0x02, 0, 0, 0, 0, 1],
        }
    }

    #[test]
    fn jail_holds_only_the_vm_files() {
        let ops = ops(
            Path::new("/usr/bin/qemu-system-x86_64"),
            &spec(AccelKind::Tcg),
            Path::new("/run/space/sandboxes/abc"),
        )
        .unwrap();
        let binds: Vec<&Path> = ops
            .iter()
            .filter_map(|o| match o {
                JailOp::Bind { dst, .. } => Some(dst.as_path()),
                _ => None,
            })
            .collect();
        assert_eq!(binds[0], Path::new("/usr"));
        assert!(binds.contains(&Path::new("/var/lib/space/sandboxes/abc/disk.ext4")));
        assert!(binds.contains(&Path::new("/run/space/sandboxes/abc")));
        assert!(binds.contains(&Path::new("/dev/urandom")));
        // QEMU under /usr needs no bind of its own; no /dev/kvm under TCG.
        assert!(!binds.contains(&Path::new("/usr/bin/qemu-system-x86_64")));
        assert!(!binds.contains(&Path::new("/dev/kvm")));
        assert!(
            !binds
                .iter()
                .any(|b| b.starts_with("/home") || b == &Path::new("/"))
        );
        // Every parent is made once, before its children.
        let mkdirs: Vec<&PathBuf> = ops
            .iter()
            .filter_map(|o| match o {
                JailOp::Mkdir(d) => Some(d),
                _ => None,
            })
            .collect();
        let pos = |p: &str| mkdirs.iter().position(|d| d.as_path() == Path::new(p));
        assert!(pos("/var").unwrap() < pos("/var/lib/space/sandboxes/abc").unwrap());
        assert_eq!(
            mkdirs
                .iter()
                .filter(|d| d.as_path() == Path::new("/run"))
                .count(),
            1
        );
        let kvm = super::ops(
            Path::new("/opt/qemu"),
            &spec(AccelKind::Kvm),
            Path::new("/run/x"),
        );
        // /opt/qemu does not exist here, but it is bound as given (canonicalized by the
        // caller); the kernel path is resolved and must exist.
        let kvm = kvm.unwrap();
        assert!(
            kvm.iter()
                .any(|o| matches!(o, JailOp::Bind { dst, .. } if dst == Path::new("/dev/kvm")))
        );
        assert!(
            kvm.iter()
                .any(|o| matches!(o, JailOp::Bind { dst, .. } if dst == Path::new("/opt/qemu")))
        );
    }

    #[test]
    fn cgroup_limits_add_qemu_overhead() {
        let l = Limits {
            cpu_millis: 1500,
            memory_mib: 512,
            pids: 10,
            rlimits: Default::default(),
            disk_mib: None,
        };
        let tcg = cgroup_limits(&l, 512, AccelKind::Tcg);
        assert_eq!(tcg.memory_mib, 512 + OVERHEAD_MIB + TCG_TB_MIB);
        assert_eq!(tcg.cpu_millis, 1500);
        assert_eq!(tcg.pids, QEMU_PIDS);
        assert_eq!(
            cgroup_limits(&l, 512, AccelKind::Kvm).memory_mib,
            512 + OVERHEAD_MIB
        );
    }

    #[test]
    fn missing_kernel_is_an_error_naming_it() {
        let mut s = spec(AccelKind::Tcg);
        s.kernel = "/nonexistent/vmlinuz".into();
        let e = ops(Path::new("/usr/bin/q"), &s, Path::new("/run/x")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/vmlinuz"), "{e}");
    }
}
