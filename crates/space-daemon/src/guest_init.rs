//! space-daemon as the init of a microvm (issue 6; the contract is in space-node's
//! `runtime/microvm/mod.rs`). The kernel starts `/init` (this binary) from the initramfs with
//! `SPACE_GUEST=vm` in its environment; [`setup`] mounts the kernel filesystems, loads the
//! modules listed in [`MODULES_LIST`], mounts the sandbox's disk ([`ROOT_DEVICE`], ext4) and
//! switches root to it the way busybox `switch_root` does. Then the daemon serves the guest
//! channel on the virtio-serial port (see [`crate::vport`]).
//!
//! A fatal error is printed on the console and the machine powers off ([`power_off`]): PID 1
//! must not exit or panic (that panics the kernel, and `panic=-1` reboots it into a loop).

use std::ffi::OsString;
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use rustix::mount::MountFlags;

use crate::config::EnvVars;

/// The modules to load, one absolute path a line, in load order.
pub const MODULES_LIST: &str = "/etc/space/modules";
/// The sandbox's disk.
pub const ROOT_DEVICE: &str = "/dev/vda";
/// Where the disk is mounted before it becomes `/`.
pub const NEW_ROOT: &str = "/newroot";
/// How long to wait for the disk (and the channel port) to appear.
pub const DEVICE_WAIT: Duration = Duration::from_secs(10);
/// `PATH` when the kernel passed none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// `finit_module` flag: the file is compressed (the kernel decompresses it).
const MODULE_INIT_COMPRESSED_FILE: i32 = 4;
/// Longest hostname the kernel takes (`__NEW_UTS_LEN`).
pub const MAX_HOSTNAME_BYTES: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum GuestInitError {
    #[error("failed to set the guest's resource limits and OOM score")]
    Limits(#[source] io::Error),
    #[error("failed to mount {what} on {target}")]
    Mount {
        what: String,
        target: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("failed to create {path}")]
    Mkdir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("failed to read {path}")]
    ReadList {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{list} line {line}: {path:?} is not an absolute path")]
    ModulePath {
        list: PathBuf,
        line: usize,
        path: String,
    },
    #[error("failed to load the kernel module {path}")]
    Module {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "no block device {path} after {waited:?} (is the disk attached as virtio-blk-device, and \
         virtio_blk in {MODULES_LIST}?)"
    )]
    NoRootDevice { path: PathBuf, waited: Duration },
    #[error("{}: {why}", space_proto::GUEST_NO_TIMER)]
    NoTimer { why: String },
    #[error("switching root to {NEW_ROOT}: {step} failed")]
    SwitchRoot {
        step: &'static str,
        #[source]
        source: io::Error,
    },
}

/// Whether this process is the init of a microvm: `SPACE_GUEST=vm` (from the kernel command
/// line) and PID 1.
pub fn is_vm_guest() -> bool {
    std::env::var_os("SPACE_GUEST").is_some_and(|v| v == "vm") && std::process::id() == 1
}

/// The whole error chain on one line.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Seconds since the kernel started (`/proc/uptime`), for boot timings.
pub fn kernel_uptime() -> Option<f64> {
    fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Prints `msg`, syncs and powers the machine off. Never returns (and never exits).
pub fn power_off(msg: &str) -> ! {
    tracing::error!("{msg}");
    eprintln!("space-daemon: fatal: {msg}; powering off");
    rustix::fs::sync();
    if let Err(e) = rustix::system::reboot(rustix::system::RebootCommand::PowerOff) {
        eprintln!("space-daemon: cannot power off: {e}");
    }
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// A fresh identity for a guest restored from a checkpoint (a template's warm state or a
/// fork): without it every VM restored from one checkpoint would share its RNG state,
/// machine-id and (stale) clock. Empty fields are left alone.
#[derive(Debug, Default)]
pub struct Identity {
    pub entropy: Vec<u8>,
    pub machine_id: String,
    pub unix_time_ns: i64,
    /// The NIC's new MAC address (6 bytes).
    pub mac: Vec<u8>,
}

impl Identity {
    pub fn is_empty(&self) -> bool {
        self.entropy.is_empty()
            && self.machine_id.is_empty()
            && self.unix_time_ns == 0
            && self.mac.is_empty()
    }

    /// Refuses bad fields before anything is changed.
    pub fn check(&self) -> Result<(), String> {
        if self.entropy.len() > space_sys::guest::MAX_ENTROPY_BYTES {
            return Err(format!(
                "entropy is {} bytes; at most {} are taken",
                self.entropy.len(),
                space_sys::guest::MAX_ENTROPY_BYTES
            ));
        }
        if !self.machine_id.is_empty()
            && (self.machine_id.len() != 32
                || !self
                    .machine_id
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
        {
            return Err(format!(
                "machine id {:?} is not 32 lowercase hex digits",
                self.machine_id
            ));
        }
        if self.unix_time_ns < 0 {
            return Err(format!("unix time {} ns is negative", self.unix_time_ns));
        }
        if !self.mac.is_empty()
            && (self.mac.len() != 6 || self.mac[0] & 1 == 1 || self.mac.iter().all(|&b| b == 0))
        {
            return Err(format!(
                "MAC address {:02x?} is not 6 bytes of a unicast address",
                self.mac
            ));
        }
        Ok(())
    }

    /// Applies it: the RNG first (so nothing after uses the checkpoint's state), then the
    /// clock, then `<root>/etc/machine-id` (written aside and renamed).
    pub fn apply(&self, root: &Path) -> io::Result<()> {
        if !self.entropy.is_empty() {
            space_sys::guest::reseed_kernel_rng(&self.entropy)?;
        }
        if self.unix_time_ns > 0 {
            space_sys::guest::set_realtime(Duration::from_nanos(self.unix_time_ns as u64))?;
        }
        if !self.machine_id.is_empty() {
            write_machine_id(root, &self.machine_id)?;
        }
        if let Ok(mac) = <[u8; 6]>::try_from(self.mac.as_slice()) {
            space_sys::netif::set_mac(space_proto::vm_link::GUEST_IFNAME, mac)?;
        }
        Ok(())
    }
}

/// The guest's link (`space_proto::vm_link`): the NIC, when there is one, at the fixed guest
/// address with the node's end as default route (loopback is the daemon's, as in every
/// sandbox). The same in every VM, so a checkpoint's configuration holds in every copy
/// restored from it.
pub fn configure_network() -> io::Result<&'static str> {
    use space_proto::vm_link::{GATEWAY, GUEST, GUEST_IFNAME, PREFIX};
    if !space_sys::netif::exists(GUEST_IFNAME) {
        return Ok("no NIC");
    }
    space_sys::netif::set_ipv4(GUEST_IFNAME, GUEST, PREFIX)?;
    space_sys::netif::set_up(GUEST_IFNAME)?;
    space_sys::netif::add_default_route(GATEWAY)?;
    Ok("eth0")
}

/// Writes `<root>/etc/machine-id` (mode 0444) through a temporary file and a rename.
pub fn write_machine_id(root: &Path, id: &str) -> io::Result<()> {
    let etc = root.join("etc");
    fs::create_dir_all(&etc)?;
    let tmp = etc.join(".machine-id.space");
    fs::write(&tmp, format!("{id}\n"))?;
    fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o444))?;
    fs::rename(&tmp, etc.join("machine-id"))
}

/// Sets the kernel's hostname (microvm only: the daemon is root of its own kernel).
pub fn set_hostname(name: &str) -> io::Result<()> {
    if name.len() > MAX_HOSTNAME_BYTES || name.contains('\0') || name.contains('/') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a hostname has at most {MAX_HOSTNAME_BYTES} bytes and no NUL or '/'"),
        ));
    }
    rustix::system::sethostname(name.as_bytes())?;
    Ok(())
}

/// The environment of the processes the daemon starts in a microvm: the kernel's (minus what
/// the kernel sets for init: `HOME=/`, `TERM=linux`) with `PATH` (when missing),
/// `HOME=/root` and `TERM=xterm-256color`.
pub fn default_env(vars: EnvVars) -> EnvVars {
    let mut out: EnvVars = vars
        .into_iter()
        .filter(|(k, _)| k != "HOME" && k != "TERM")
        .collect();
    if !out.iter().any(|(k, _)| k == "PATH") {
        out.push(("PATH".into(), DEFAULT_PATH.into()));
    }
    out.push(("HOME".into(), OsString::from("/root")));
    out.push(("TERM".into(), OsString::from("xterm-256color")));
    out
}

/// The module list: absolute paths, one a line; blank lines and `#` comments skipped.
pub fn parse_modules_list(list: &Path, text: &str) -> Result<Vec<PathBuf>, GuestInitError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if !line.starts_with('/') {
            return Err(GuestInitError::ModulePath {
                list: list.to_owned(),
                line: i + 1,
                path: line.to_owned(),
            });
        }
        out.push(PathBuf::from(line));
    }
    Ok(out)
}

/// Logs a step with its duration.
fn step<T>(what: &str, f: impl FnOnce() -> Result<T, GuestInitError>) -> Result<T, GuestInitError> {
    let start = Instant::now();
    let r = f()?;
    tracing::info!(ms = start.elapsed().as_secs_f64() * 1e3, "init: {what}");
    Ok(r)
}

fn mkdir(path: &Path, mode: u32) -> Result<(), GuestInitError> {
    match fs::DirBuilder::new().mode(mode).create(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(source) => Err(GuestInitError::Mkdir {
            path: path.to_owned(),
            source,
        }),
    }
}

/// `mount -t fstype source target -o data`; `EBUSY` (already mounted there) is fine when
/// `busy_ok`.
fn mount(
    source: &str,
    target: &str,
    fstype: &str,
    flags: MountFlags,
    data: Option<&std::ffi::CStr>,
    busy_ok: bool,
) -> Result<(), GuestInitError> {
    mkdir(Path::new(target), 0o755)?;
    match rustix::mount::mount(source, target, fstype, flags, data) {
        Ok(()) => Ok(()),
        Err(Errno::BUSY) if busy_ok => Ok(()),
        Err(e) => Err(GuestInitError::Mount {
            what: format!("{fstype} {source}"),
            target: target.into(),
            source: e.into(),
        }),
    }
}

/// When the kernel found no `/dev/console` in the initramfs, init has no stdio: reopen it
/// on the console once devtmpfs is mounted, so that the log reaches ttyS0.
fn ensure_console() {
    if rustix::io::fcntl_getfd(std::io::stderr()).is_ok() {
        return;
    }
    if let Ok(fd) = rustix::fs::open(
        "/dev/console",
        OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        let _ = rustix::stdio::dup2_stdin(&fd);
        let _ = rustix::stdio::dup2_stdout(&fd);
        let _ = rustix::stdio::dup2_stderr(&fd);
    }
}

/// Loads each module with `finit_module`; one already loaded (`EEXIST`) is fine.
pub fn load_modules(modules: &[PathBuf]) -> Result<(), GuestInitError> {
    for path in modules {
        let start = Instant::now();
        let err = |source: io::Error| GuestInitError::Module {
            path: path.clone(),
            source,
        };
        let file = fs::File::open(path).map_err(err)?;
        let flags = if path.extension().is_some_and(|e| e == "ko") {
            0
        } else {
            MODULE_INIT_COMPRESSED_FILE
        };
        match rustix::system::finit_module(&file, c"", flags) {
            Ok(()) => {}
            Err(Errno::EXIST) => {}
            Err(e) => return Err(err(e.into())),
        }
        tracing::debug!(
            module = %path.display(),
            ms = start.elapsed().as_secs_f64() * 1e3,
            "init: loaded"
        );
    }
    Ok(())
}

/// Waits until `path` is a block device.
fn wait_for_block_device(path: &Path, timeout: Duration) -> Result<(), GuestInitError> {
    use std::os::unix::fs::FileTypeExt;
    let start = Instant::now();
    loop {
        if fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device()) {
            return Ok(());
        }
        if start.elapsed() >= timeout {
            return Err(GuestInitError::NoRootDevice {
                path: path.to_owned(),
                waited: timeout,
            });
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Removes everything under `dir` that lives on device `dev` (not crossing mounts), except
/// `keep`. Best effort: returns how many entries could not be removed.
fn remove_tree(dir: &Path, dev: u64, keep: &Path) -> usize {
    let Ok(entries) = fs::read_dir(dir) else {
        return 1;
    };
    let mut failed = 0;
    for e in entries.flatten() {
        let path = e.path();
        if path == keep {
            continue;
        }
        let Ok(md) = fs::symlink_metadata(&path) else {
            failed += 1;
            continue;
        };
        if md.dev() != dev {
            continue;
        }
        if md.is_dir() {
            failed += remove_tree(&path, dev, keep);
            failed += usize::from(fs::remove_dir(&path).is_err());
        } else {
            failed += usize::from(fs::remove_file(&path).is_err());
        }
    }
    failed
}

/// Whether `path` is a mount point (a different device than its parent).
fn is_mount_point(path: &Path) -> bool {
    let parent = path.parent().unwrap_or(Path::new("/"));
    match (fs::metadata(path), fs::metadata(parent)) {
        (Ok(a), Ok(b)) => a.dev() != b.dev(),
        _ => false,
    }
}

/// Everything before the channel: kernel filesystems, modules, the disk, switch root, /tmp.
pub fn setup() -> Result<(), GuestInitError> {
    let start = Instant::now();
    let nosuid = MountFlags::NOSUID;
    step(
        "mounted /dev, /proc, /sys, /dev/pts, /dev/shm, /run",
        || {
            // devtmpfs may already be there (CONFIG_DEVTMPFS_MOUNT).
            mount(
                "devtmpfs",
                "/dev",
                "devtmpfs",
                nosuid,
                Some(c"mode=0755"),
                true,
            )?;
            ensure_console();
            let nsde = nosuid | MountFlags::NODEV | MountFlags::NOEXEC;
            mount("proc", "/proc", "proc", nsde, None, true)?;
            mount("sysfs", "/sys", "sysfs", nsde, None, true)?;
            mount(
                "devpts",
                "/dev/pts",
                "devpts",
                nosuid | MountFlags::NOEXEC,
                Some(c"newinstance,ptmxmode=0666,mode=620,gid=5"),
                true,
            )?;
            mount(
                "shm",
                "/dev/shm",
                "tmpfs",
                nosuid | MountFlags::NODEV,
                Some(c"mode=1777"),
                true,
            )?;
            mount(
                "run",
                "/run",
                "tmpfs",
                nosuid | MountFlags::NODEV,
                Some(c"mode=0755"),
                true,
            )
        },
    )?;
    step("timer interrupts seen", check_timer_interrupts)?;
    let list = Path::new(MODULES_LIST);
    let modules = match fs::read_to_string(list) {
        Ok(text) => parse_modules_list(list, &text)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            tracing::warn!("no {MODULES_LIST}: loading no modules");
            Vec::new()
        }
        Err(source) => {
            return Err(GuestInitError::ReadList {
                path: list.to_owned(),
                source,
            });
        }
    };
    step(&format!("loaded {} modules", modules.len()), || {
        load_modules(&modules)
    })?;
    step(&format!("{ROOT_DEVICE} appeared"), || {
        wait_for_block_device(Path::new(ROOT_DEVICE), DEVICE_WAIT)
    })?;
    step(&format!("mounted {ROOT_DEVICE} on {NEW_ROOT}"), || {
        mount(
            ROOT_DEVICE,
            NEW_ROOT,
            "ext4",
            MountFlags::empty(),
            None,
            false,
        )
    })?;
    step("switched root", switch_root)?;
    match configure_network() {
        Ok(what) => tracing::info!("init: network: {what}"),
        // Not fatal: the channel does not need it; the user's programs will say so.
        Err(e) => tracing::warn!(error = %e, "init: the network link could not be configured"),
    }
    step("/tmp ready", || {
        if !is_mount_point(Path::new("/tmp")) {
            mkdir(Path::new("/tmp"), 0o1777)?;
            mount(
                "tmpfs",
                "/tmp",
                "tmpfs",
                nosuid | MountFlags::NODEV,
                Some(c"mode=1777"),
                false,
            )?;
        }
        Ok(())
    })?;
    // What devtmpfs lacks and programs expect (ignored when the disk's /dev... is devtmpfs).
    for (link, target) in [
        ("/dev/fd", "/proc/self/fd"),
        ("/dev/stdin", "/proc/self/fd/0"),
        ("/dev/stdout", "/proc/self/fd/1"),
        ("/dev/stderr", "/proc/self/fd/2"),
    ] {
        let _ = std::os::unix::fs::symlink(target, link);
    }
    // The same resource limits and OOM standing as in a namespace sandbox, where the node
    // sets them from outside (decision 0041).
    step("resource limits and OOM score set", || {
        space_sys::process::set_own_rlimits(&space_sys::process::DEFAULT_RLIMITS)
            .and_then(|()| {
                fs::write(
                    "/proc/self/oom_score_adj",
                    space_sys::process::DAEMON_OOM_SCORE_ADJ.to_string(),
                )
            })
            .map_err(GuestInitError::Limits)
    })?;
    tracing::info!(
        ms = start.elapsed().as_secs_f64() * 1e3,
        kernel_uptime_s = kernel_uptime().unwrap_or(-1.0),
        "init: set up"
    );
    Ok(())
}

/// The local timer interrupts counted in `/proc/interrupts` (`LOC:`, every CPU); None when
/// the kernel shows no such line.
pub fn local_timer_interrupts(proc_interrupts: &str) -> Option<u64> {
    let line = proc_interrupts
        .lines()
        .find(|l| l.trim_start().starts_with("LOC:"))?;
    Some(
        line.trim_start()["LOC:".len()..]
            .split_whitespace()
            .map_while(|w| w.parse::<u64>().ok())
            .sum(),
    )
}

/// Refuses a guest whose kernel has no timer interrupt (see `space_proto::GUEST_NO_TIMER`):
/// by the time init runs, a working LAPIC timer has ticked hundreds of times.
fn check_timer_interrupts() -> Result<(), GuestInitError> {
    let text = fs::read_to_string("/proc/interrupts").map_err(|e| GuestInitError::NoTimer {
        why: format!("cannot read /proc/interrupts ({e})"),
    })?;
    match local_timer_interrupts(&text) {
        Some(0) => Err(GuestInitError::NoTimer {
            why: "the kernel disabled its APIC timer (calibration at boot, on a starved host)"
                .to_owned(),
        }),
        _ => Ok(()),
    }
}

/// busybox `switch_root`: move the kernel filesystems under the new root, free the
/// initramfs (best effort), then make the new root `/`.
fn switch_root() -> Result<(), GuestInitError> {
    let new_root = Path::new(NEW_ROOT);
    for d in ["/dev", "/proc", "/sys", "/run"] {
        let target = new_root.join(&d[1..]);
        mkdir(&target, 0o755)?;
        rustix::mount::mount_move(d, &target).map_err(|e| GuestInitError::Mount {
            what: format!("(move) {d}"),
            target: target.clone(),
            source: e.into(),
        })?;
    }
    let root_dev = fs::symlink_metadata("/")
        .map(|m| m.dev())
        .map_err(|source| GuestInitError::SwitchRoot {
            step: "stat /",
            source,
        })?;
    let failed = remove_tree(Path::new("/"), root_dev, new_root);
    if failed > 0 {
        tracing::warn!(failed, "could not remove all of the initramfs");
    }
    let sr = |step: &'static str| {
        move |e: Errno| GuestInitError::SwitchRoot {
            step,
            source: e.into(),
        }
    };
    rustix::process::chdir(new_root).map_err(sr("chdir"))?;
    rustix::mount::mount_move(".", "/").map_err(sr("mount --move . /"))?;
    rustix::process::chroot(".").map_err(sr("chroot ."))?;
    rustix::process::chdir("/").map_err(sr("chdir /"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_list_keeps_order_and_rejects_relative_paths() {
        let list = Path::new("/etc/space/modules");
        let text = "# virtio first\n/lib/modules/6.1/virtio.ko\n\n  /lib/modules/6.1/virtio_ring.ko  \n/lib/modules/6.1/virtio_blk.ko.xz\n";
        assert_eq!(
            parse_modules_list(list, text).unwrap(),
            vec![
                PathBuf::from("/lib/modules/6.1/virtio.ko"),
                PathBuf::from("/lib/modules/6.1/virtio_ring.ko"),
                PathBuf::from("/lib/modules/6.1/virtio_blk.ko.xz"),
            ]
        );
        let err = parse_modules_list(list, "/a.ko\nkernel/b.ko\n").unwrap_err();
        assert_eq!(
            err.to_string(),
            "/etc/space/modules line 2: \"kernel/b.ko\" is not an absolute path"
        );
        assert!(parse_modules_list(list, "").unwrap().is_empty());
    }

    #[test]
    fn missing_module_names_the_file() {
        let err = load_modules(&[PathBuf::from("/nonexistent/space-test.ko")]).unwrap_err();
        let msg = chain(&err);
        assert!(
            msg.starts_with("failed to load the kernel module /nonexistent/space-test.ko: "),
            "{msg}"
        );
    }

    #[test]
    fn default_env_replaces_what_the_kernel_sets_for_init() {
        let env = default_env(vec![
            ("HOME".into(), "/".into()),
            ("TERM".into(), "linux".into()),
            ("LANG".into(), "C.UTF-8".into()),
        ]);
        let get = |k: &str| {
            env.iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.to_str().unwrap().to_owned())
        };
        assert_eq!(get("HOME").as_deref(), Some("/root"));
        assert_eq!(get("TERM").as_deref(), Some("xterm-256color"));
        assert_eq!(get("PATH").as_deref(), Some(DEFAULT_PATH));
        assert_eq!(get("LANG").as_deref(), Some("C.UTF-8"));
        assert_eq!(env.len(), 4);
        // A PATH the kernel passed is kept.
        let env = default_env(vec![("PATH".into(), "/bin".into())]);
        assert!(env.contains(&("PATH".into(), "/bin".into())));
    }

    #[test]
    fn bad_hostnames_are_refused_before_the_kernel_sees_them() {
        let long = "a".repeat(MAX_HOSTNAME_BYTES + 1);
        for bad in [long.as_str(), "a\0b", "a/b"] {
            let e = set_hostname(bad).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
            assert!(e.to_string().contains("at most 64 bytes"), "{e}");
        }
    }

    #[test]
    fn remove_tree_keeps_the_new_root() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::create_dir_all(d.join("lib/modules/6.1")).unwrap();
        fs::write(d.join("lib/modules/6.1/x.ko"), "x").unwrap();
        fs::write(d.join("init"), "x").unwrap();
        std::os::unix::fs::symlink("/nonexistent", d.join("link")).unwrap();
        fs::create_dir(d.join("newroot")).unwrap();
        fs::write(d.join("newroot/keep"), "x").unwrap();
        let dev = fs::metadata(d).unwrap().dev();
        assert_eq!(remove_tree(d, dev, &d.join("newroot")), 0);
        let left: Vec<_> = fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![OsString::from("newroot")]);
        assert!(d.join("newroot/keep").exists());
    }

    #[test]
    fn local_timer_interrupts_are_counted_over_every_cpu() {
        let one = "           CPU0\n 48:   0   IO-APIC   9-edge  ACPI:Ged\n\
                   LOC:        522   Local timer interrupts\nSPU:   0   Spurious\n";
        assert_eq!(local_timer_interrupts(one), Some(522));
        let two = "       CPU0  CPU1\nLOC:   10   32   Local timer interrupts\n";
        assert_eq!(local_timer_interrupts(two), Some(42));
        let dead = "       CPU0\nLOC:          0   Local timer interrupts\n";
        assert_eq!(local_timer_interrupts(dead), Some(0));
        assert_eq!(local_timer_interrupts("no such line\n"), None);
    }

    #[test]
    fn identity_fields_are_checked_before_anything_changes() {
        let ok = Identity {
            entropy: vec![7; 64],
            machine_id: "0123456789abcdef0123456789abcdef".into(),
            unix_time_ns: 1,
            mac: vec![0x02, 0x53, 0x50, 0, 0, 1],
        };
        assert!(ok.check().is_ok() && !ok.is_empty());
        assert!(Identity::default().is_empty());
        for bad in [
            Identity {
                entropy: vec![0; space_sys::guest::MAX_ENTROPY_BYTES + 1],
                ..Default::default()
            },
            Identity {
                machine_id: "0123456789ABCDEF0123456789ABCDEF".into(),
                ..Default::default()
            },
            Identity {
                machine_id: "../etc/passwd".into(),
                ..Default::default()
            },
            Identity {
                unix_time_ns: -1,
                ..Default::default()
            },
            Identity {
                mac: vec![0x01, 0, 0, 0, 0, 1],
                ..Default::default()
            },
            Identity {
                mac: vec![0; 6],
                ..Default::default()
            },
            Identity {
                mac: vec![0x02; 7],
                ..Default::default()
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn machine_id_is_replaced_whole() {
        let d = tempfile::tempdir().unwrap();
        write_machine_id(d.path(), "0123456789abcdef0123456789abcdef").unwrap();
        write_machine_id(d.path(), "fedcba9876543210fedcba9876543210").unwrap();
        let got = fs::read_to_string(d.path().join("etc/machine-id")).unwrap();
        assert_eq!(got, "fedcba9876543210fedcba9876543210\n");
        assert_eq!(fs::read_dir(d.path().join("etc")).unwrap().count(), 1);
    }
}
