//! The microvm runtime (issue 6): one QEMU `microvm` machine per sandbox with its own kernel
//! (Debian's cloud kernel), space-daemon as the guest's init, the sandbox's disk as an ext4
//! image (a reflink copy of its template's), and the guest channel over virtio-serial, exposed
//! on the host as a unix socket. See docs/decisions/0014-microvm.md.
//!
//! The contract with the guest (space-daemon's guest-init mode):
//! - kernel command line: `console=ttyS0 panic=-1 quiet rdinit=/init SPACE_GUEST=vm`, plus
//!   `tsc_early_khz=2000000` under TCG;
//! - initramfs: `/init` is the static space-daemon; `/lib/modules/<version>/...` holds the
//!   modules the guest needs, and `/etc/space/modules` lists their paths in load order
//!   (absolute paths, one per line: virtio_ring, virtio, virtio_mmio, virtio_blk,
//!   virtio_console); `/dev/console` exists (char 5:1); nothing else is there (no busybox, no
//!   udev: the guest creates its own mount points);
//! - root disk: `/dev/vda`, ext4, read-write; QEMU honours flushes (`cache=writeback`) and
//!   discards (`discard=unmap`);
//! - channel: the virtio-serial port named `space.0` (QEMU: a `virtserialport` on a
//!   `socket` chardev in server mode at `LaunchPlan::channel_socket`); without udev there is
//!   no `/dev/virtio-ports/space.0` link: find the `vportNpM` whose
//!   `/sys/class/virtio-ports/vportNpM/name` reads `space.0` and open `/dev/vportNpM`;
//! - readiness: once the guest serves the channel, it writes the line
//!   `space-daemon: serving` (exactly, [`READY_MARKER`]) to the console; `launch` returns when
//!   it sees that line (or QEMU's `VSERPORT_CHANGE` event saying the guest opened `space.0`),
//!   so the node's channel connect (5 s) does not have to wait for the guest's boot;
//! - failure: a guest init that cannot go on writes `space-daemon: failed <why>` (exactly,
//!   [`FAILED_MARKER`] + reason) to the console and powers off; `launch` reports `<why>`;
//! - after connecting, the node sends `Personalize { env, hostname }`;
//! - the serial console goes to the node through `<run_dir>/console.sock`, which keeps it in
//!   `<run_dir>/console.log` and `console.log.1`, 1 MiB each at most (`console.rs`).

mod checkpoint;
#[cfg(test)]
mod checkpoint_tests;
mod console;
mod disk;
mod initramfs;
mod jail;
mod vmnet;

pub use vmnet::mac_for;
mod qemu;
mod qmp;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fmt;
use std::fs;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use space_sys::ns;

pub use self::checkpoint::{CheckpointInfo, MemoryCopy, RestoreTimes, STATE_FILE};
pub use self::disk::{HEADROOM_BYTES, clone_disk, ensure_template_disk};
use self::initramfs::ExtraFile;
pub use self::initramfs::{Cpio, GuestKernel, InitramfsError, MODULES_LIST, WANTED_MODULES};
pub use self::qemu::BootTimes;
use self::qemu::{AccelKind, Extras, VmSpec};
use self::qmp::Qmp;
use super::{LaunchPlan, Launched, Runtime, RuntimeError};
use crate::api::Limits;
use crate::cgroup::{CgroupManager, LinuxCgroups};

/// The console line a guest writes once it serves its channel.
pub const READY_MARKER: &str = "space-daemon: serving";
/// The prefix of the console line a guest writes when its init cannot go on.
pub const FAILED_MARKER: &str = "space-daemon: failed ";
/// The name of the virtio-serial port carrying the guest channel.
pub const CHANNEL_PORT: &str = "space.0";
/// Where `ensure_guest_kernel` (scripts/lib.sh) installs the guest kernel.
pub const DEFAULT_VM_DIR: &str = "/usr/local/lib/space/vm";
pub const DEFAULT_QEMU: &str = "qemu-system-x86_64";
/// Smallest guest: Debian's cloud kernel and the daemon run in 128 MiB.
pub const MIN_MEMORY_MIB: u64 = 128;
/// How long the KVM probe may take before KVM is declared unusable.
pub const KVM_PROBE_TIMEOUT: Duration = Duration::from_secs(3);
/// QEMU's status of a VM left paused by a checkpoint (its state saved); `cont` resumes it.
const POSTMIGRATE: &str = "postmigrate";
/// Boots of one launch when the guest kernel comes up without a timer interrupt.
const BOOT_ATTEMPTS: u32 = 3;
/// How long a QMP round trip outside launch may take (pause, resume, status, quit).
const QMP_TIMEOUT: Duration = Duration::from_secs(2);

/// Which accelerator QEMU uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Accel {
    /// KVM when a quick probe boots a guest kernel with it, else TCG (with a warning).
    #[default]
    Auto,
    Kvm,
    Tcg,
}

impl FromStr for Accel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Accel::Auto),
            "kvm" => Ok(Accel::Kvm),
            "tcg" => Ok(Accel::Tcg),
            _ => Err(format!(
                "unknown accelerator {s:?}: expected auto, kvm or tcg"
            )),
        }
    }
}

impl fmt::Display for Accel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Accel::Auto => "auto",
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        })
    }
}

#[derive(Debug, Clone)]
pub struct MicrovmConfig {
    /// The guest kernel as scripts/up unpacks it. Default [`DEFAULT_VM_DIR`].
    pub vm_dir: PathBuf,
    /// QEMU: a bare name is looked up in PATH. Default [`DEFAULT_QEMU`].
    pub qemu: PathBuf,
    /// The static space-daemon, copied into the initramfs as `/init` when the runtime is
    /// created (`LaunchPlan::daemon_binary` is not used by this runtime).
    pub daemon_binary: PathBuf,
    /// Generated assets (the initramfs, the KVM probe's logs). Default `/run/space/microvm`.
    pub work_dir: PathBuf,
    pub accel: Accel,
    /// How long launch waits for the guest to serve its channel. Default 30 s.
    pub boot_timeout: Duration,
    /// How long destroy waits for QEMU to quit before SIGKILL, and then for it to die.
    /// Default 3 s.
    pub destroy_timeout: Duration,
    /// The node's per-sandbox run directories (`<run_root>/<id>` = `LaunchPlan::run_dir`).
    /// Lets the runtime reach the QMP socket of a VM it did not start (adopted after a node
    /// restart) to pause, resume, query or quit it. None: adopted VMs can only be killed.
    pub run_root: Option<PathBuf>,
    /// Run each QEMU jailed (see `jail.rs`): as the sandbox's `uid_base`, in a minimal mount
    /// namespace, with `no_new_privs`, inside a per-sandbox cgroup. Default true.
    pub jail: bool,
    /// Where the cgroup hierarchy is mounted (v2, or hybrid v1). Default /sys/fs/cgroup.
    pub cgroup_root: PathBuf,
    /// The cgroup (per controller on v1) that holds one cgroup per jailed QEMU.
    /// Default `space-vm`.
    pub cgroup_parent: String,
    /// Keep each guest's RAM in a file `<dir>/<id>.mem` (QEMU `memory-backend-file`,
    /// `share=on`) instead of anonymous memory, so that [`MicrovmRuntime::checkpoint`] saves
    /// only device state and a restore maps a (reflinked) copy of the file. None (the
    /// default): anonymous RAM, and checkpoints are refused. See decision 0014, "Memory
    /// checkpoints", for where the directory should live.
    pub memory_dir: Option<PathBuf>,
    /// How a VM the node restores from a checkpoint (`Runtime::restore`) maps its RAM, a
    /// reflink of the checkpoint's next to its disk: privately (the default: writes stay in
    /// QEMU's anonymous memory, nothing reaches the disk while it runs; its own checkpoints
    /// carry the RAM in their stream) or shared (its writes go to the file, written back to
    /// the node's disk; its checkpoints and forks reflink the file). Decision 0014, "Memory
    /// snapshots".
    pub restored_ram: RestoredRam,
}

/// See [`MicrovmConfig::restored_ram`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RestoredRam {
    #[default]
    Private,
    Shared,
}

impl std::str::FromStr for RestoredRam {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "private" => Ok(RestoredRam::Private),
            "shared" => Ok(RestoredRam::Shared),
            _ => Err(format!(
                "unknown RAM mapping {s:?}: expected private or shared"
            )),
        }
    }
}

impl Default for MicrovmConfig {
    fn default() -> Self {
        Self {
            vm_dir: PathBuf::from(DEFAULT_VM_DIR),
            qemu: PathBuf::from(DEFAULT_QEMU),
            daemon_binary: PathBuf::from("/usr/local/lib/space/space-daemon"),
            work_dir: PathBuf::from("/run/space/microvm"),
            accel: Accel::Auto,
            // TCG (no usable KVM) boots in 2-6 s alone, far slower on a loaded host.
            boot_timeout: Duration::from_secs(60),
            destroy_timeout: Duration::from_secs(3),
            run_root: None,
            jail: true,
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            cgroup_parent: jail::DEFAULT_CGROUP_PARENT.to_owned(),
            memory_dir: None,
            restored_ram: RestoredRam::Private,
        }
    }
}

/// A VM started by this process.
#[derive(Debug)]
struct Tracked {
    pid: u32,
    pidfd: OwnedFd,
    exited: bool,
    qmp: PathBuf,
    channel: PathBuf,
    boot: BootTimes,
}

impl Tracked {
    /// A VM now serving its channel: what the node records, and what this runtime tracks.
    fn started(
        pid: u32,
        start_time: u64,
        pidfd: OwnedFd,
        spec: &VmSpec,
        boot: BootTimes,
    ) -> (Launched, Tracked) {
        (
            Launched {
                init_pid: pid,
                start_time,
            },
            Tracked {
                pid,
                pidfd,
                exited: false,
                qmp: spec.qmp.clone(),
                channel: spec.channel_socket.clone(),
                boot,
            },
        )
    }
}

#[derive(Debug)]
struct Inner {
    cfg: MicrovmConfig,
    qemu: PathBuf,
    kernel: GuestKernel,
    initrd: PathBuf,
    /// The first 12 hex digits of the SHA-256 of the kernel and initramfs: a checkpoint of
    /// one image cannot restore under another (its memory holds the old daemon).
    image_id: String,
    accel: AccelKind,
    accel_note: String,
    host_cpus: u32,
    tracked: Mutex<HashMap<String, Tracked>>,
    reaper: OnceLock<()>,
    /// With the jail: the QEMU cgroups and the (empty) directory each jail's root is mounted
    /// on, in the jail's own mount namespace.
    jail: Option<JailSetup>,
}

#[derive(Debug)]
struct JailSetup {
    cgroups: LinuxCgroups,
    mountpoint: PathBuf,
}

impl Inner {
    /// Reap every tracked QEMU that has exited (we are its parent, so nobody else will).
    fn reap_exited(&self) {
        let mut tracked = self.tracked.lock().unwrap();
        for t in tracked.values_mut().filter(|t| !t.exited) {
            t.exited = qemu::exited(t.pidfd.as_fd()).is_some();
        }
    }

    /// Tracks a QEMU just started for VM `id` (a launch or a restore). A QEMU tracked under
    /// that id before (a relaunch of a live id) is stopped: it must not linger unowned.
    fn track(&self, id: &str, tracked: Tracked) {
        let old = self.tracked.lock().unwrap().insert(id.to_owned(), tracked);
        // It may have exited before it was tracked (its SIGCHLD found nothing to reap).
        self.reap_exited();
        if let Some(mut old) = old {
            let timeout = self.cfg.destroy_timeout;
            tokio::task::spawn_blocking(move || stop_tracked(&mut old, timeout));
        }
    }

    /// Start (once) the task that reaps exited QEMUs on SIGCHLD; it ends with the runtime.
    fn ensure_reaper(self: &Arc<Self>) {
        self.reaper.get_or_init(|| {
            let weak = Arc::downgrade(self);
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()) {
                Ok(mut sigchld) => {
                    tokio::spawn(async move {
                        while sigchld.recv().await.is_some() {
                            let Some(inner) = weak.upgrade() else { break };
                            inner.reap_exited();
                        }
                    });
                }
                Err(e) => tracing::error!(error = %e, "cannot watch SIGCHLD; exited QEMUs stay zombies until destroyed"),
            }
        });
    }

    /// Kills whatever is left in VM `id`'s QEMU cgroup and removes it (best effort, logged).
    fn remove_cgroup(&self, id: &str) {
        let Some(j) = &self.jail else { return };
        if let Err(e) = j
            .cgroups
            .kill_all(id, self.cfg.destroy_timeout)
            .and_then(|()| j.cgroups.remove(id))
        {
            tracing::warn!(id, error = %e, "cannot remove the QEMU cgroup");
        }
    }

    /// Where VM `id` keeps its RAM, with file-backed RAM configured.
    fn memory_file(&self, id: &str) -> Option<PathBuf> {
        let dir = self.cfg.memory_dir.as_ref()?;
        valid_id(id).then(|| dir.join(format!("{id}.mem")))
    }

    /// The QMP socket of VM `id`: the tracked one, else under `run_root`.
    fn qmp_path(&self, id: &str) -> Option<PathBuf> {
        if let Some(t) = self.tracked.lock().unwrap().get(id) {
            return Some(t.qmp.clone());
        }
        self.cfg
            .run_root
            .as_ref()
            .filter(|_| valid_id(id))
            .map(|r| r.join(id).join("qmp.sock"))
    }
}

/// The microvm runtime. Cheap to clone.
#[derive(Debug, Clone)]
pub struct MicrovmRuntime {
    inner: Arc<Inner>,
}

fn setup(step: &'static str) -> impl FnOnce(io::Error) -> RuntimeError {
    move |source| RuntimeError::Setup { step, source }
}

fn setup_msg(step: &'static str, kind: io::ErrorKind, msg: String) -> RuntimeError {
    RuntimeError::Setup {
        step,
        source: io::Error::new(kind, msg),
    }
}

impl From<InitramfsError> for RuntimeError {
    fn from(e: InitramfsError) -> Self {
        let kind = match &e {
            InitramfsError::KernelMissing { .. } | InitramfsError::ModuleMissing(_) => {
                io::ErrorKind::NotFound
            }
            _ => io::ErrorKind::InvalidData,
        };
        RuntimeError::Setup {
            step: "prepare the guest kernel and initramfs",
            source: io::Error::new(kind, e),
        }
    }
}

/// `qemu` itself when it names a path, else the first match in PATH.
fn find_qemu(qemu: &Path) -> Result<PathBuf, RuntimeError> {
    let hint = "apt-get install qemu-system-x86";
    if qemu.components().count() > 1 {
        return if qemu.is_file() {
            Ok(qemu.to_path_buf())
        } else {
            Err(setup_msg(
                "find QEMU",
                io::ErrorKind::NotFound,
                format!("{} does not exist: {hint}", qemu.display()),
            ))
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(qemu))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            setup_msg(
                "find QEMU",
                io::ErrorKind::NotFound,
                format!("{} is not in PATH: {hint}", qemu.display()),
            )
        })
}

fn valid_id(id: &str) -> bool {
    !id.is_empty() && !id.contains('/') && !id.starts_with('.')
}

/// vCPUs for `limits`: the CPU quota rounded up to whole cores, at least 1, at most the
/// host's CPUs (more vCPUs than host CPUs only add contention).
pub fn vcpus_for(limits: &Limits, host_cpus: u32) -> u32 {
    limits.cpu_millis.div_ceil(1000).clamp(1, host_cpus.max(1))
}

/// Guest RAM for `limits`, at least [`MIN_MEMORY_MIB`].
pub fn memory_mib_for(limits: &Limits) -> u64 {
    limits.memory_mib.max(MIN_MEMORY_MIB)
}

impl MicrovmRuntime {
    /// Checks QEMU and the guest kernel, builds the initramfs around `cfg.daemon_binary` and
    /// decides the accelerator (probing KVM under [`Accel::Auto`], at most
    /// [`KVM_PROBE_TIMEOUT`]). Blocking: call it from `spawn_blocking` in async code.
    pub fn new(cfg: MicrovmConfig) -> Result<Self, RuntimeError> {
        let daemon = fs::read(&cfg.daemon_binary).map_err(|e| {
            setup_msg(
                "read the space-daemon binary",
                e.kind(),
                format!("cannot read {}: {e}", cfg.daemon_binary.display()),
            )
        })?;
        initramfs::check_static(&cfg.daemon_binary, &daemon)?;
        Self::with_init(cfg, &daemon, &[])
    }

    /// [`MicrovmRuntime::new`] with any `/init` and extra initramfs files (tests boot a
    /// shell script as init).
    fn with_init(
        cfg: MicrovmConfig,
        init: &[u8],
        extra: &[ExtraFile],
    ) -> Result<Self, RuntimeError> {
        let qemu = find_qemu(&cfg.qemu)?;
        let kernel = GuestKernel::locate(&cfg.vm_dir)?;
        let order = kernel.load_order(WANTED_MODULES)?;
        fs::create_dir_all(&cfg.work_dir).map_err(setup("create the microvm work dir"))?;
        let bytes = initramfs::build(&kernel, &order, init, extra)?;
        let initrd = cfg.work_dir.join("initramfs.cpio");
        let tmp = cfg
            .work_dir
            .join(format!(".initramfs.cpio.tmp-{}", std::process::id()));
        // Written aside and renamed: a running QEMU read the old file at its start already,
        // and a concurrent reader never sees half a file.
        fs::write(&tmp, &bytes)
            .and_then(|()| fs::rename(&tmp, &initrd))
            .map_err(setup("write the initramfs"))?;
        let (accel, accel_note) = match cfg.accel {
            Accel::Kvm => (AccelKind::Kvm, "kvm (forced by configuration)".to_owned()),
            Accel::Tcg => (AccelKind::Tcg, "tcg (forced by configuration)".to_owned()),
            Accel::Auto => {
                let t0 = Instant::now();
                let probe =
                    qemu::probe_kvm(&qemu, &kernel.vmlinuz, &cfg.work_dir, KVM_PROBE_TIMEOUT);
                let took = t0.elapsed().as_secs_f64();
                match probe {
                    Ok(()) => (
                        AccelKind::Kvm,
                        format!("kvm (a probe guest booted under KVM in {took:.2} s)"),
                    ),
                    Err(why) => {
                        tracing::warn!(
                            probe_secs = took,
                            "KVM is unusable, microvms run under TCG (slow emulation): {why}"
                        );
                        (
                            AccelKind::Tcg,
                            format!("tcg (KVM unusable: {why}; probe took {took:.2} s)"),
                        )
                    }
                }
            }
        };
        let jail = if cfg.jail {
            let cgroups = LinuxCgroups::detect(&cfg.cgroup_root, &cfg.cgroup_parent)?;
            let mountpoint = cfg.work_dir.join("jail-root");
            fs::create_dir_all(&mountpoint).map_err(setup("create the jail mountpoint"))?;
            fs::set_permissions(&mountpoint, fs::Permissions::from_mode(0o700))
                .map_err(setup("restrict the jail mountpoint"))?;
            Some(JailSetup {
                cgroups,
                mountpoint,
            })
        } else {
            None
        };
        // The jail execs QEMU by this path, inside a root that mirrors the host's paths.
        let qemu = fs::canonicalize(&qemu).map_err(setup("resolve the QEMU path"))?;
        let host_cpus = std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1);
        tracing::info!(accel = %accel_note, kernel = %kernel.version, initramfs_bytes = bytes.len(), "microvm runtime ready");
        let image_id = {
            use sha2::Digest;
            let mut h = sha2::Sha256::new();
            h.update(kernel.version.as_bytes());
            h.update(&bytes);
            crate::ids::hex(&h.finalize()[..6])
        };
        Ok(Self {
            inner: Arc::new(Inner {
                cfg,
                qemu,
                kernel,
                initrd,
                image_id,
                accel,
                accel_note,
                host_cpus,
                tracked: Mutex::new(HashMap::new()),
                reaper: OnceLock::new(),
                jail,
            }),
        })
    }

    /// The accelerator in use: "kvm" or "tcg".
    pub fn accel(&self) -> &str {
        self.inner.accel.as_str()
    }

    /// The accelerator and why it was chosen (the KVM probe's verdict and cost).
    pub fn accel_note(&self) -> &str {
        &self.inner.accel_note
    }

    /// The initramfs every VM boots.
    pub fn initramfs(&self) -> &Path {
        &self.inner.initrd
    }

    /// How long VM `id` (started by this process) took to answer QMP and to serve its
    /// channel, counted from QEMU's spawn.
    pub fn boot_times(&self, id: &str) -> Option<BootTimes> {
        self.inner.tracked.lock().unwrap().get(id).map(|t| t.boot)
    }

    /// The guest kernel's version.
    pub fn kernel_version(&self) -> &str {
        &self.inner.kernel.version
    }

    fn memory_file(&self, id: &str) -> Option<PathBuf> {
        self.inner.memory_file(id)
    }

    /// Best effort: a failed launch or restore leaves no memory file behind.
    fn remove_memory_file(&self, id: &str) {
        if let Some(m) = self.memory_file(id) {
            let _ = remove_if_exists(&m);
        }
    }

    fn spec(&self, plan: &LaunchPlan, disk: &Path) -> VmSpec {
        VmSpec {
            kernel: self.inner.kernel.vmlinuz.clone(),
            initrd: self.inner.initrd.clone(),
            accel: self.inner.accel,
            memory_mib: memory_mib_for(&plan.limits),
            vcpus: vcpus_for(&plan.limits, self.inner.host_cpus),
            disk: disk.to_path_buf(),
            channel_socket: plan.channel_socket.clone(),
            console: plan.run_dir.join("console.log"),
            console_socket: plan.run_dir.join("console.sock"),
            qmp: plan.run_dir.join("qmp.sock"),
            mac: vmnet::mac_for(&plan.id),
        }
    }
}

fn remove_if_exists(p: &Path) -> io::Result<()> {
    match fs::remove_file(p) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

fn validate(plan: &LaunchPlan) -> Result<&Path, RuntimeError> {
    let bad = |what: String| {
        setup_msg(
            "validate the launch plan",
            io::ErrorKind::InvalidInput,
            what,
        )
    };
    if !valid_id(&plan.id) {
        return Err(bad(format!("bad sandbox id {:?}", plan.id)));
    }
    let disk = plan.disk.as_deref().ok_or_else(|| {
        bad("the microvm runtime needs LaunchPlan::disk (the sandbox's ext4 image)".to_owned())
    })?;
    if !disk.is_file() {
        return Err(bad(format!("disk image {} does not exist", disk.display())));
    }
    Ok(disk)
}

/// Creates the run dir and the channel socket's directory and removes what a previous QEMU
/// left there.
fn prepare_dirs(plan: &LaunchPlan, spec: &VmSpec) -> Result<(), RuntimeError> {
    fs::create_dir_all(&plan.run_dir).map_err(setup("create the run dir"))?;
    if let Some(dir) = plan.channel_socket.parent() {
        fs::create_dir_all(dir).map_err(setup("create the channel socket directory"))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(setup("restrict the channel socket directory"))?;
    }
    let rotated = console::rotated(&spec.console);
    for stale in [&spec.channel_socket, &spec.qmp, &spec.console, &rotated] {
        remove_if_exists(stale).map_err(setup("remove a stale socket or console log"))?;
    }
    Ok(())
}

/// Spawns QEMU for `spec` (jailed when configured) and opens a pidfd on it, which owns the
/// child from then on. Returns the pidfd, the pid and how long the spawn took.
fn start_qemu(
    rt: &MicrovmRuntime,
    plan: &LaunchPlan,
    spec: &VmSpec,
    extras: Extras<'_>,
    log: &Path,
) -> Result<(OwnedFd, u32, Duration), RuntimeError> {
    let t0 = Instant::now();
    let link = vmnet::prepare(plan.netns.as_ref().map(|n| &*n.ns))
        .map_err(setup("give the VM its network link"))?;
    tracing::debug!(
        id = %plan.id,
        link_us = t0.elapsed().as_micros() as u64,
        slot = plan.netns.is_some(),
        "VM network link ready"
    );
    let extras = Extras {
        tap_fd: Some(link.tap.as_raw_fd()),
        ..extras
    };
    let console = console::ConsoleListener::bind(&spec.console_socket)
        .map_err(setup("listen for the VM's console"))?;
    let spawned = match &rt.inner.jail {
        Some(j) => spawn_jailed(rt, j, plan, spec, extras, link, log),
        None => qemu::spawn_with(
            &rt.inner.qemu,
            &spec.args_with(extras),
            log,
            None,
            vec![link.tap],
        )
        .map_err(setup("start QEMU")),
    };
    let spawn_took = t0.elapsed();
    let mut child = spawned?;
    console.keep(spec.console.clone(), rt.inner.cfg.boot_timeout);
    let pid = child.id();
    let pidfd = match ns::pidfd_open(pid) {
        Ok(fd) => fd,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            rt.inner.remove_cgroup(&plan.id);
            return Err(setup("open a pidfd on QEMU")(e));
        }
    };
    // From here the pidfd owns the child: waitid on it reaps QEMU (dropping `child` does not).
    drop(child);
    Ok((pidfd, pid, spawn_took))
}

/// Kills and reaps a QEMU that did not get ready, and removes its sockets and cgroup.
fn kill_started(rt: &MicrovmRuntime, plan: &LaunchPlan, spec: &VmSpec, pidfd: &OwnedFd) {
    let _ = ns::pidfd_send_signal(pidfd.as_fd(), libc::SIGKILL);
    let _ = ns::waitid_pidfd(pidfd.as_fd(), 0);
    for socket in [&spec.channel_socket, &spec.qmp, &spec.console_socket] {
        let _ = remove_if_exists(socket);
    }
    rt.inner.remove_cgroup(&plan.id);
}

fn launch_blocking(
    rt: &MicrovmRuntime,
    plan: &LaunchPlan,
) -> Result<(Launched, Tracked), RuntimeError> {
    let disk = validate(plan)?;
    let spec = rt.spec(plan, disk);
    prepare_dirs(plan, &spec)?;
    let memory_file = match rt.memory_file(&plan.id) {
        Some(m) => {
            checkpoint::fresh_memory_file(&m, spec.memory_mib)?;
            Some(m)
        }
        None => None,
    };
    let extras = Extras {
        memory_file: memory_file.as_deref(),
        incoming: false,
        private_memory: false,
        tap_fd: None,
    };
    let log = plan.run_dir.join("qemu.log");
    let t0 = Instant::now();
    let (pidfd, pid, spawn_took) = match start_qemu(rt, plan, &spec, extras, &log) {
        Ok(s) => s,
        Err(e) => {
            rt.remove_memory_file(&plan.id);
            return Err(e);
        }
    };
    let kill = |pidfd: &OwnedFd| {
        kill_started(rt, plan, &spec, pidfd);
        rt.remove_memory_file(&plan.id);
    };
    let times = match qemu::wait_ready(
        pidfd.as_fd(),
        &spec.qmp,
        &spec.channel_socket,
        &spec.console,
        &log,
        rt.inner.cfg.boot_timeout,
    ) {
        Ok(t) => BootTimes {
            spawn: spawn_took,
            ..t
        },
        Err(why) => {
            kill(&pidfd);
            return Err(RuntimeError::NotReady(why));
        }
    };
    let start_time = match qemu::read_stat(pid) {
        Ok(st) => st.start_time,
        Err(e) => {
            kill(&pidfd);
            return Err(setup("read QEMU's start time")(e));
        }
    };
    tracing::info!(
        id = %plan.id,
        pid,
        accel = rt.accel(),
        jailed = rt.inner.jail.is_some(),
        spawn_ms = spawn_took.as_secs_f64() * 1e3,
        qmp_ready_ms = times.qmp_ready.as_millis() as u64,
        guest_ready_ms = times.guest_ready.as_millis() as u64,
        ready_by = times.ready_by,
        spawn_to_ready_ms = t0.elapsed().as_millis() as u64,
        "microvm running"
    );
    Ok(Tracked::started(pid, start_time, pidfd, &spec, times))
}

/// Chowns the VM's files to `plan.uid_base`, creates the QEMU cgroup with the sandbox's
/// limits (RAM plus QEMU's overhead) and spawns QEMU jailed into it. On error the cgroup is
/// gone again.
fn spawn_jailed(
    rt: &MicrovmRuntime,
    j: &JailSetup,
    plan: &LaunchPlan,
    spec: &VmSpec,
    extras: Extras<'_>,
    link: vmnet::VmLink,
    log: &Path,
) -> Result<std::process::Child, RuntimeError> {
    let (uid, gid) = (plan.uid_base, plan.uid_base);
    jail::chown_files(uid, gid, &[&plan.run_dir, &spec.disk, &spec.console_socket])
        .map_err(setup("give the VM's files to its uid"))?;
    if let Some(m) = extras.memory_file {
        std::os::unix::fs::chown(m, Some(uid), Some(gid))
            .map_err(setup("give the VM's memory file to its uid"))?;
    }
    let ops = jail::ops_with(&rt.inner.qemu, spec, &plan.run_dir, extras.memory_file)
        .map_err(setup("plan the jail"))?;
    let limits = jail::cgroup_limits(&plan.limits, spec.memory_mib, spec.accel);
    j.cgroups.create(&plan.id, &limits)?;
    let spawned = jail::open_procs(&j.cgroups.dirs(&plan.id))
        .map_err(setup("open the QEMU cgroup"))
        .and_then(|procs| {
            let groups = jail::groups(spec.accel);
            qemu::spawn_with(
                &rt.inner.qemu,
                &spec.args_with(extras),
                log,
                Some(space_sys::jail::JailSpec {
                    mountpoint: &j.mountpoint,
                    ops: &ops,
                    uid,
                    gid,
                    groups: &groups,
                    cgroup_procs: procs,
                    netns: Some(link.netns),
                }),
                vec![link.tap],
            )
            .map_err(setup("start QEMU jailed"))
        });
    if spawned.is_err() {
        rt.inner.remove_cgroup(&plan.id);
    }
    spawned
}

fn is_alive(l: &Launched) -> bool {
    matches!(qemu::read_stat(l.init_pid), Ok(st) if st.start_time == l.start_time && st.state != 'Z' && st.state != 'X')
}

/// Ask QEMU to quit over QMP (best effort: a wedged or gone QEMU is killed by the caller).
fn qmp_quit(path: &Path) {
    if let Ok(mut q) = Qmp::connect(path, QMP_TIMEOUT) {
        let _ = q.execute("quit", None, Instant::now() + QMP_TIMEOUT);
    }
}

/// Poll `gone` until it holds or `timeout` passes; whether it held.
fn wait_until(timeout: Duration, mut gone: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(1);
    loop {
        if gone() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// Stops a VM this process started: QMP quit, SIGKILL after `timeout`, reaped.
fn stop_tracked(t: &mut Tracked, timeout: Duration) {
    if !t.exited && qemu::exited(t.pidfd.as_fd()).is_none() {
        qmp_quit(&t.qmp);
        if !wait_until(timeout, || qemu::exited(t.pidfd.as_fd()).is_some()) {
            tracing::warn!(pid = t.pid, "QEMU did not quit in time; killing it");
            let _ = ns::pidfd_send_signal(t.pidfd.as_fd(), libc::SIGKILL);
            if !wait_until(timeout, || qemu::exited(t.pidfd.as_fd()).is_some()) {
                tracing::error!(pid = t.pid, "QEMU survived SIGKILL for {timeout:?}");
            }
        }
    }
    t.exited = true;
}

/// Stops a VM started by an earlier node process: its identity is checked through a pidfd
/// (pinning the pid) and the start time, so a recycled pid is never signalled. Not our
/// child: whoever adopted it reaps it.
fn stop_adopted(l: &Launched, qmp: Option<&Path>, timeout: Duration) {
    let Ok(pidfd) = ns::pidfd_open(l.init_pid) else {
        return;
    };
    if !is_alive(l) {
        return;
    }
    if let Some(q) = qmp {
        qmp_quit(q);
    }
    if !wait_until(timeout, || !is_alive(l)) {
        let _ = ns::pidfd_send_signal(pidfd.as_fd(), libc::SIGKILL);
        if !wait_until(timeout, || !is_alive(l)) {
            tracing::error!(
                pid = l.init_pid,
                "adopted QEMU survived SIGKILL for {timeout:?}"
            );
        }
    }
}

fn join_error(step: &'static str) -> impl FnOnce(tokio::task::JoinError) -> RuntimeError {
    move |e| RuntimeError::Setup {
        step,
        source: io::Error::other(e),
    }
}

/// The limits a microvm cannot have: rlimits (its guest has its own kernel's).
pub(crate) fn check_limits(limits: &Limits) -> Result<(), String> {
    if !limits.rlimits.is_default() {
        return Err(
            "rlimits are set only in namespace sandboxes: a microvm's guest has the \
                    defaults (1024 open files, no core dumps, 8 MiB of locked memory), and its \
                    root may raise them within its own kernel"
                .to_owned(),
        );
    }
    Ok(())
}

/// A fresh identity for a microvm guest (new RNG seed, machine-id, the host's clock), sent
/// with every Personalize: a restored or forked guest would otherwise keep its checkpoint's.
pub(crate) fn guest_identity(id: &str) -> space_proto::PersonalizeRequest {
    use rand::Rng;
    let mut entropy = vec![0u8; 64];
    rand::rng().fill(&mut entropy[..]);
    let mut machine_id = [0u8; 16];
    rand::rng().fill(&mut machine_id[..]);
    space_proto::PersonalizeRequest {
        entropy,
        machine_id: machine_id.iter().map(|b| format!("{b:02x}")).collect(),
        unix_time_ns: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as i64)
            .unwrap_or(0),
        mac: mac_for(id).to_vec(),
        ..Default::default()
    }
}

#[async_trait]
impl Runtime for MicrovmRuntime {
    fn kind(&self) -> crate::api::RuntimeKind {
        crate::api::RuntimeKind::Microvm
    }

    /// The guest behind its tap (decision 0014, Networking).
    fn service_address(&self) -> std::net::Ipv4Addr {
        space_proto::vm_link::GUEST
    }

    /// The guest's resolver is its gateway, the tap's slot end, which DNATs port 53 on to
    /// the slot's gateway and so to the node's DNS (`nft::slot_table`).
    fn dns_address(&self, _slot_gateway: std::net::Ipv4Addr) -> std::net::Ipv4Addr {
        space_proto::vm_link::GATEWAY
    }

    fn guest_identity(&self, id: &str) -> Option<space_proto::PersonalizeRequest> {
        Some(guest_identity(id))
    }

    /// A guest personalizes itself: its hostname and identity come over the channel
    /// ([`Runtime::guest_identity`]). Its RAM and vCPUs are fixed when its VM starts.
    async fn personalize(
        &self,
        id: &str,
        _launched: &Launched,
        limits: Option<&Limits>,
        _hostname: &str,
    ) -> Result<(), RuntimeError> {
        match limits {
            None => Ok(()),
            Some(_) => Err(super::unsupported(self.kind(), "change the limits of", id)),
        }
    }

    /// `<accel>-<MiB>m-<vCPUs>c-n1-<image id>`: what a restore must match. None without
    /// file-backed RAM (no checkpoints).
    fn checkpoint_key(&self, limits: &Limits) -> Option<String> {
        self.inner.cfg.memory_dir.as_ref()?;
        // `n1`: the device set (one virtio-net NIC since networking); a checkpoint made with
        // other devices cannot be restored.
        Some(format!(
            "{}-{}m-{}c-n1-{}",
            self.inner.accel.as_str(),
            memory_mib_for(limits),
            vcpus_for(limits, self.inner.host_cpus),
            self.inner.image_id
        ))
    }

    async fn checkpoint(&self, id: &str, dir: &Path, resume: bool) -> Result<(), RuntimeError> {
        MicrovmRuntime::checkpoint(self, id, dir, resume)
            .await
            .map(|_| ())
    }

    fn verify_checkpoint(&self, dir: &Path, limits: &Limits) -> Result<(), RuntimeError> {
        checkpoint::verify(dir, memory_mib_for(limits))
    }

    /// Private RAM (a reflink of the checkpoint's, `share=off`): the node restores
    /// templates' warm checkpoints, which many VMs start from (decision 0014).
    async fn restore(&self, plan: &LaunchPlan, dir: &Path) -> Result<Launched, RuntimeError> {
        let mode = match self.inner.cfg.restored_ram {
            RestoredRam::Private => checkpoint::RestoreMode::Private,
            RestoredRam::Shared => checkpoint::RestoreMode::SharedFile,
        };
        self.restore_timed(plan, dir, mode).await.map(|(l, _)| l)
    }

    async fn launch(&self, plan: &LaunchPlan) -> Result<Launched, RuntimeError> {
        self.inner.ensure_reaper();
        let rt = self.clone();
        let owned = plan.clone();
        let (launched, tracked) = tokio::task::spawn_blocking(move || {
            // A guest whose kernel came up without a timer interrupt refuses to go on
            // (`space_proto::GUEST_NO_TIMER`): a matter of that boot, so boot again.
            let mut attempt = 1;
            loop {
                match launch_blocking(&rt, &owned) {
                    Err(RuntimeError::NotReady(why))
                        if why.contains(space_proto::GUEST_NO_TIMER) && attempt < BOOT_ATTEMPTS =>
                    {
                        tracing::warn!(
                            id = %owned.id,
                            attempt,
                            "the guest kernel came up without a timer interrupt: booting again"
                        );
                        attempt += 1;
                    }
                    r => return r,
                }
            }
        })
        .await
        .map_err(join_error("join the launch task"))??;
        self.inner.track(&plan.id, tracked);
        Ok(launched)
    }

    async fn destroy(&self, id: &str, launched: Option<&Launched>) -> Result<(), RuntimeError> {
        let timeout = self.inner.cfg.destroy_timeout;
        let tracked = self.inner.tracked.lock().unwrap().remove(id);
        let qmp = self.inner.qmp_path(id);
        let launched = launched.cloned();
        let inner = self.inner.clone();
        let id = id.to_owned();
        tokio::task::spawn_blocking(move || -> Result<(), RuntimeError> {
            if let Some(mut t) = tracked {
                stop_tracked(&mut t, timeout);
                remove_if_exists(&t.channel).map_err(setup("remove the channel socket"))?;
                remove_if_exists(&t.qmp).map_err(setup("remove the QMP socket"))?;
            } else if let Some(l) = launched {
                stop_adopted(&l, qmp.as_deref(), timeout);
                if let Some(q) = &qmp {
                    remove_if_exists(q).map_err(setup("remove the QMP socket"))?;
                }
            }
            if let Some(j) = &inner.jail {
                j.cgroups.kill_all(&id, timeout)?;
                j.cgroups.remove(&id)?;
            }
            if let Some(m) = inner.memory_file(&id) {
                remove_if_exists(&m).map_err(setup("remove the memory file"))?;
            }
            Ok(())
        })
        .await
        .map_err(join_error("join the destroy task"))?
    }

    fn alive(&self, launched: &Launched) -> bool {
        is_alive(launched)
    }

    fn cpu_usage_usec(&self, id: &str) -> Option<u64> {
        self.inner.jail.as_ref()?.cgroups.cpu_usage_usec(id)
    }

    fn memory_bytes(&self, id: &str) -> Option<u64> {
        if let Some(j) = &self.inner.jail {
            return j.cgroups.memory_bytes(id);
        }
        // Unjailed: QEMU's resident memory (guest RAM it touched plus its own).
        let pid = self.inner.tracked.lock().unwrap().get(id)?.pid;
        space_sys::process::rss_bytes(pid)
    }

    async fn set_frozen(&self, id: &str, frozen: bool) -> Result<(), RuntimeError> {
        let step = if frozen {
            "pause the VM"
        } else {
            "resume the VM"
        };
        let Some(path) = self.inner.qmp_path(id) else {
            return Err(setup_msg(
                step,
                io::ErrorKind::NotFound,
                format!("no QMP socket known for VM {id}"),
            ));
        };
        tokio::task::spawn_blocking(move || -> Result<(), RuntimeError> {
            let err = |e: qmp::QmpError| setup_msg(step, io::ErrorKind::Other, e.to_string());
            let deadline = Instant::now() + QMP_TIMEOUT;
            let mut q = Qmp::connect(&path, QMP_TIMEOUT).map_err(err)?;
            q.execute(if frozen { "stop" } else { "cont" }, None, deadline)
                .map_err(err)?;
            // `stop` returns once every vCPU is paused; check what QEMU reports now.
            let want = if frozen { "paused" } else { "running" };
            let now = q.status(deadline).map_err(err)?;
            if now != want && !(frozen && now == POSTMIGRATE) {
                return Err(setup_msg(
                    step,
                    io::ErrorKind::Other,
                    format!("the VM is {now:?}, not {want:?}"),
                ));
            }
            Ok(())
        })
        .await
        .map_err(join_error("join the pause task"))?
    }

    fn is_frozen(&self, id: &str) -> bool {
        let Some(path) = self.inner.qmp_path(id) else {
            return false;
        };
        let deadline = Instant::now() + QMP_TIMEOUT;
        Qmp::connect(&path, QMP_TIMEOUT)
            .and_then(|mut q| q.status(deadline))
            .is_ok_and(|s| s == "paused" || s == POSTMIGRATE)
    }
}
