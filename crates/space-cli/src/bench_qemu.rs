//! The QEMU `microvm` peer of `space bench`: how long a minimal VM takes to run `/bin/true`
//! from a template's rootfs, cold (boot) and from a saved snapshot (restore).
//!
//! Each call builds, in a temporary directory, an ext4 image of the rootfs (`mkfs.ext4 -d`, no
//! mounting) and an initramfs (a newc cpio written here) holding the host's static busybox, the
//! virtio modules of the guest kernel and a generated `/init`. The guest kernel is Debian's
//! cloud kernel, which `scripts/up` unpacks into [`VM_DIR`] (`ensure_guest_kernel` in
//! `scripts/lib.sh`). QEMU runs under TCG (`-accel tcg`): the hosts we bench on offer only
//! nested KVM, where unmodified guest kernels crawl.
//!
//! What is timed:
//! - **boot**: from spawning QEMU until `/init` prints [`BOOTED`] on the serial console, which
//!   it does after loading the modules, mounting the image on `/dev/vda` and running
//!   `chroot /newroot /bin/true` successfully. The VM then powers off (not timed).
//! - **restore**: a VM is booted once to the point where `/init` prints [`READY`] and blocks
//!   reading the console; QMP `stop` + `migrate` to `exec:cat > state` saves it. Each sample
//!   then spawns a QEMU with `-S -incoming "exec:cat state"`, waits over QMP for the incoming
//!   migration to finish, sends `cont`, writes `ping-<i>` to the serial port and stops the
//!   clock when the guest answers `pong ping-<i>`. That answer needs the restored guest to
//!   take the UART interrupt, wake the shell blocked in `read` and write back, so it proves
//!   the restored guest runs user code, not only that QEMU accepted the state.
//!
//! Everything is synchronous (threads, no tokio); callers in async code use `spawn_blocking`.
//! Every QEMU is killed and reaped on every path ([`Vm`] does it on drop), and every wait has a
//! deadline.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Value, json};

/// Where `ensure_guest_kernel` (scripts/lib.sh) installs the guest kernel: `vmlinuz`,
/// `version` and `modules/<version>/{kernel/..., modules.dep, modules.builtin}`.
pub const VM_DIR: &str = "/usr/local/lib/space/vm";
pub const QEMU: &str = "qemu-system-x86_64";
/// Debian's busybox-static; the initramfs runs it.
pub const BUSYBOX: &str = "/bin/busybox";
/// One boot, one migration, one restore: each must finish within this under TCG.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(60);
/// At most this many samples per call (each costs seconds under TCG).
pub const MAX_N: usize = 1000;

/// Serial line `/init` prints after `/bin/true` ran in the rootfs (boot mode).
pub const BOOTED: &str = "space-bench: booted";
/// Serial line `/init` prints when it waits on the console for pings (restore mode).
pub const READY: &str = "space-bench: ready";
const PONG: &str = "space-bench: pong ";
const FAILED: &str = "space-bench: failed ";

/// Guest modules the VM needs, loaded in dependency order (with what modules.dep says they
/// need). ext4 is built into Debian's cloud kernel; should it ever be a module, it is added.
/// The serial console is the built-in 8250, so virtio_console is not needed here.
const WANTED_MODULES: &[&str] = &["virtio_mmio", "virtio_blk", "ext4"];

const KERNEL_CMDLINE: &str = "console=ttyS0 tsc_early_khz=2000000 panic=-1 quiet";

/// Boot a fresh microvm `n` times; each sample is spawn -> [`BOOTED`] in milliseconds.
pub fn qemu_boot(rootfs: &Path, n: usize) -> Result<Vec<f64>> {
    check_n(n)?;
    let setup = Setup::new(rootfs, InitMode::Boot)?;
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let t0 = Instant::now();
        let mut vm = Vm::spawn(&setup.spec(None, false))?;
        let deadline = t0 + STEP_TIMEOUT;
        vm.wait_for(deadline, |m| matches!(m, Marker::Booted))
            .with_context(|| format!("boot {} of {n}", i + 1))?;
        samples.push(ms(t0.elapsed()));
        // poweroff -f follows at once; a VM that does not exit is killed on drop.
        vm.wait_exit(Instant::now() + Duration::from_secs(10));
    }
    Ok(samples)
}

/// Restore a saved microvm `n` times; each sample is spawn -> guest answered a ping after
/// `cont`, in milliseconds (see the module documentation).
pub fn qemu_restore(rootfs: &Path, n: usize) -> Result<Vec<f64>> {
    check_n(n)?;
    let setup = Setup::new(rootfs, InitMode::Ready)?;
    let state = setup.dir.path().join("state");
    save_snapshot(&setup, &state).context("saving the snapshot to restore from")?;
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let t0 = Instant::now();
        let deadline = t0 + STEP_TIMEOUT;
        let spec = setup.spec(Some(incoming_uri(&state)?), true);
        let mut vm = Vm::spawn(&spec)?;
        let mut qmp = Qmp::connect(
            spec.qmp.as_deref().unwrap_or(Path::new("")),
            deadline,
            &mut vm,
        )
        .with_context(|| format!("restore {} of {n}", i + 1))?;
        wait_incoming(&mut qmp, deadline).with_context(|| format!("restore {} of {n}", i + 1))?;
        qmp.execute("cont", None)?;
        let token = format!("ping-{i}");
        vm.send_line(&token)?;
        vm.wait_for(deadline, |m| matches!(m, Marker::Pong(t) if *t == token))
            .with_context(|| format!("restore {} of {n}", i + 1))?;
        samples.push(ms(t0.elapsed()));
        let _ = qmp.execute("quit", None);
        vm.wait_exit(Instant::now() + Duration::from_secs(5));
    }
    Ok(samples)
}

fn check_n(n: usize) -> Result<()> {
    if n == 0 || n > MAX_N {
        bail!("the number of QEMU runs must be between 1 and {MAX_N}, got {n}");
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Boot to [`READY`], then `stop` and `migrate` the VM into `state`.
fn save_snapshot(setup: &Setup, state: &Path) -> Result<()> {
    let deadline = Instant::now() + STEP_TIMEOUT;
    let spec = setup.spec(None, false);
    let mut vm = Vm::spawn(&spec)?;
    vm.wait_for(deadline, |m| matches!(m, Marker::Ready))?;
    let mut qmp = Qmp::connect(
        spec.qmp.as_deref().unwrap_or(Path::new("")),
        deadline,
        &mut vm,
    )?;
    qmp.execute("stop", None)?;
    qmp.execute("migrate", Some(json!({ "uri": outgoing_uri(state)? })))?;
    loop {
        let r = qmp.execute("query-migrate", None)?;
        match r.get("status").and_then(Value::as_str) {
            Some("completed") => break,
            Some("failed") | Some("cancelled") => bail!(
                "migration to {} failed: {}",
                state.display(),
                r.get("error-desc")
                    .and_then(Value::as_str)
                    .unwrap_or("no reason given")
            ),
            _ if Instant::now() > deadline => bail!(
                "migration to {} did not finish within {} s",
                state.display(),
                STEP_TIMEOUT.as_secs()
            ),
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    let _ = qmp.execute("quit", None);
    vm.wait_exit(Instant::now() + Duration::from_secs(5));
    Ok(())
}

/// Wait until the incoming migration has loaded (the VM leaves `inmigrate`; with `-S` it then
/// sits paused until `cont`).
fn wait_incoming(qmp: &mut Qmp, deadline: Instant) -> Result<()> {
    loop {
        let r = qmp.execute("query-status", None)?;
        match r.get("status").and_then(Value::as_str) {
            Some("inmigrate") => {}
            Some("paused") | Some("prelaunch") | Some("running") => return Ok(()),
            other => bail!("incoming migration ended in VM state {other:?}"),
        }
        if Instant::now() > deadline {
            bail!(
                "incoming migration did not finish within {} s",
                STEP_TIMEOUT.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `exec:` URIs run through `/bin/sh -c`; our paths are temporary directories, so refuse
/// anything a shell would read differently rather than quote it.
fn shell_safe(p: &Path) -> Result<&str> {
    let s = p.to_str().context("the migration path is not UTF-8")?;
    if s.is_empty()
        || !s
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-+".contains(c))
    {
        bail!("migration path {s:?} has characters outside [A-Za-z0-9/._+-]");
    }
    Ok(s)
}

fn outgoing_uri(state: &Path) -> Result<String> {
    Ok(format!("exec:cat > {}", shell_safe(state)?))
}

fn incoming_uri(state: &Path) -> Result<String> {
    Ok(format!("exec:cat {}", shell_safe(state)?))
}

// ---------------------------------------------------------------------------------------------
// Setup: binaries, guest kernel, disk image, initramfs.

/// Where the guest kernel lives, as `ensure_guest_kernel` lays it out.
#[derive(Debug, Clone)]
pub struct GuestKernel {
    pub vmlinuz: PathBuf,
    pub version: String,
    /// `modules/<version>`; modules.dep paths are relative to it.
    pub modules: PathBuf,
}

impl GuestKernel {
    pub fn locate(vm_dir: &Path) -> Result<Self> {
        let hint = "guest kernel missing: run scripts/up (it unpacks Debian's \
                    linux-image-cloud-amd64 into /usr/local/lib/space/vm)";
        let vmlinuz = vm_dir.join("vmlinuz");
        let version_file = vm_dir.join("version");
        if !vmlinuz.is_file() || !version_file.is_file() {
            bail!(
                "{hint}: no {} or {}",
                vmlinuz.display(),
                version_file.display()
            );
        }
        let version = std::fs::read_to_string(&version_file)
            .with_context(|| format!("cannot read {}", version_file.display()))?
            .trim()
            .to_string();
        let modules = vm_dir.join("modules").join(&version);
        if !modules.join("modules.dep").is_file() {
            bail!("{hint}: no {}", modules.join("modules.dep").display());
        }
        Ok(Self {
            vmlinuz,
            version,
            modules,
        })
    }

    /// Module files (relative to `modules`) to load, in load order, for [`WANTED_MODULES`].
    fn load_order(&self) -> Result<Vec<String>> {
        let read = |name: &str| {
            let p = self.modules.join(name);
            std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))
        };
        load_order(
            &read("modules.dep")?,
            &read("modules.builtin")?,
            WANTED_MODULES,
        )
    }
}

/// `foo/bar/virtio-blk.ko` -> `virtio_blk` (how the kernel names modules).
fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    let stem = file.split(".ko").next().unwrap_or(file);
    stem.replace('-', "_")
}

/// Load order for `wanted`: every module after all it depends on, each once. Modules built
/// into the kernel (listed in modules.builtin) are skipped; anything else missing from
/// modules.dep is an error.
fn load_order(modules_dep: &str, builtin: &str, wanted: &[&str]) -> Result<Vec<String>> {
    let builtin: BTreeSet<String> = builtin.lines().map(module_name).collect();
    let mut deps: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
    for line in modules_dep.lines().filter(|l| !l.trim().is_empty()) {
        let (path, rest) = line
            .split_once(':')
            .with_context(|| format!("modules.dep line without ':': {line:?}"))?;
        let needs = rest.split_whitespace().map(str::to_string).collect();
        deps.insert(module_name(path), (path.trim().to_string(), needs));
    }
    fn visit(
        name: &str,
        deps: &BTreeMap<String, (String, Vec<String>)>,
        builtin: &BTreeSet<String>,
        seen: &mut BTreeSet<String>,
        out: &mut Vec<String>,
    ) -> Result<()> {
        if !seen.insert(name.to_string()) {
            return Ok(());
        }
        let Some((path, needs)) = deps.get(name) else {
            if builtin.contains(name) {
                return Ok(());
            }
            bail!(
                "guest module {name} is neither built in nor in {VM_DIR}; \
                 rerun scripts/up (ensure_guest_kernel installs GUEST_MODULES)"
            );
        };
        // depmod lists dependencies so that the last one loads first.
        for d in needs.iter().rev() {
            visit(&module_name(d), deps, builtin, seen, out)?;
        }
        out.push(path.clone());
        Ok(())
    }
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for w in wanted {
        visit(&w.replace('-', "_"), &deps, &builtin, &mut seen, &mut out)?;
    }
    Ok(out)
}

/// What `/init` does after mounting the rootfs and running `/bin/true` in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InitMode {
    /// Print [`BOOTED`] and power off.
    Boot,
    /// Print [`READY`], then answer each console line `x` with `pong x`, forever.
    Ready,
}

/// The generated `/init` (busybox sh). `modules` are paths under `/lib/modules/<version>`.
fn init_script(version: &str, modules: &[String], mode: InitMode) -> String {
    let mut s = String::from(
        "#!/bin/busybox sh\n\
         # Generated by space bench (QEMU microvm peer).\n\
         b=/bin/busybox\n",
    );
    s += &format!("fail() {{ echo \"{FAILED}$*\"; $b poweroff -f; exit 1; }}\n");
    s += "$b mount -t devtmpfs dev /dev || fail mount devtmpfs\n";
    for m in modules {
        s += &format!(
            "$b insmod /lib/modules/{version}/{m} || fail insmod {}\n",
            module_name(m)
        );
    }
    s += "i=0\n\
          while [ ! -b /dev/vda ]; do\n\
          \x20   i=$((i+1)); [ $i -gt 2000 ] && fail no /dev/vda after 20 s\n\
          \x20   $b usleep 10000\n\
          done\n\
          $b mount -t ext4 -o ro /dev/vda /newroot || fail mount /dev/vda\n\
          $b chroot /newroot /bin/true || fail /bin/true in the rootfs\n";
    match mode {
        InitMode::Boot => {
            s += &format!("echo \"{BOOTED}\"\n$b poweroff -f\n");
        }
        InitMode::Ready => {
            s += &format!(
                "$b stty -echo\n\
                 echo \"{READY}\"\n\
                 while read -r line; do echo \"{PONG}$line\"; done\n\
                 fail console closed\n"
            );
        }
    }
    s
}

/// A newc ("070701") cpio archive writer, the format the kernel unpacks as initramfs.
struct Cpio<W: Write> {
    out: W,
    written: u64,
    next_ino: u32,
}

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFCHR: u32 = 0o020000;

impl<W: Write> Cpio<W> {
    fn new(out: W) -> Self {
        Self {
            out,
            written: 0,
            next_ino: 1,
        }
    }

    fn dir(&mut self, name: &str) -> std::io::Result<()> {
        self.entry(name, S_IFDIR | 0o755, 2, (0, 0), &[])
    }

    fn file(&mut self, name: &str, mode: u32, data: &[u8]) -> std::io::Result<()> {
        self.entry(name, S_IFREG | mode, 1, (0, 0), data)
    }

    fn char_dev(&mut self, name: &str, mode: u32, major: u32, minor: u32) -> std::io::Result<()> {
        self.entry(name, S_IFCHR | mode, 1, (major, minor), &[])
    }

    /// Writes the trailer and returns the writer.
    fn finish(mut self) -> std::io::Result<W> {
        self.next_ino = 0;
        self.entry("TRAILER!!!", 0, 1, (0, 0), &[])?;
        Ok(self.out)
    }

    fn entry(
        &mut self,
        name: &str,
        mode: u32,
        nlink: u32,
        rdev: (u32, u32),
        data: &[u8],
    ) -> std::io::Result<()> {
        let size = u32::try_from(data.len()).map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "{name}: {} bytes exceed the newc limit of 4 GiB",
                    data.len()
                ),
            )
        })?;
        let ino = self.next_ino;
        self.next_ino += 1;
        let header = format!(
            "070701{ino:08x}{mode:08x}{:08x}{:08x}{nlink:08x}{:08x}{size:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            0, // uid
            0, // gid
            0, // mtime
            0, // devmajor
            0, // devminor
            rdev.0,
            rdev.1,
            name.len() + 1,
            0, // check
        );
        self.put(header.as_bytes())?;
        self.put(name.as_bytes())?;
        self.put(&[0])?;
        self.pad()?;
        self.put(data)?;
        self.pad()
    }

    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.out.write_all(b)?;
        self.written += b.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> std::io::Result<()> {
        let n = (4 - (self.written % 4)) % 4;
        self.put(&[0u8; 3][..n as usize])
    }
}

/// The initramfs: directories, `/dev/console`, busybox, the modules (same layout as on the
/// host, under `/lib/modules/<version>`) and `/init`.
fn build_initramfs(kernel: &GuestKernel, busybox: &[u8], mode: InitMode) -> Result<Vec<u8>> {
    let modules = kernel.load_order()?;
    let mut cpio = Cpio::new(Vec::new());
    for d in ["bin", "dev", "proc", "sys", "newroot", "lib", "lib/modules"] {
        cpio.dir(d)?;
    }
    cpio.char_dev("dev/console", 0o600, 5, 1)?;
    cpio.file("bin/busybox", 0o755, busybox)?;
    let mut dirs = BTreeSet::new();
    for m in &modules {
        let rel = format!("lib/modules/{}/{m}", kernel.version);
        let mut parent = Path::new(&rel).parent();
        let mut missing = Vec::new();
        while let Some(p) = parent.filter(|p| p != &Path::new("lib/modules")) {
            if dirs.insert(p.to_path_buf()) {
                missing.push(p.to_path_buf());
            }
            parent = p.parent();
        }
        for p in missing.iter().rev() {
            cpio.dir(p.to_str().unwrap_or_default())?;
        }
        let src = kernel.modules.join(m);
        let data = std::fs::read(&src).with_context(|| format!("cannot read {}", src.display()))?;
        cpio.file(&rel, 0o644, &data)?;
    }
    cpio.file(
        "init",
        0o755,
        init_script(&kernel.version, &modules, mode).as_bytes(),
    )?;
    Ok(cpio.finish()?)
}

fn find_binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Bytes under `root` (files and symlinks, not following them).
fn tree_size(root: &Path) -> Result<u64> {
    let mut total = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).with_context(|| format!("cannot list {}", d.display()))? {
            let e = e?;
            let md = e.file_type()?;
            if md.is_dir() {
                stack.push(e.path());
            } else {
                total += e.metadata()?.len();
            }
        }
    }
    Ok(total)
}

/// An ext4 image of `rootfs` at `out`, made without mounting (`mkfs.ext4 -d`).
fn make_image(mkfs: &Path, rootfs: &Path, out: &Path) -> Result<()> {
    let bytes = tree_size(rootfs)?;
    // Room for metadata and the journal: twice the content plus 32 MiB.
    let mib = bytes.div_ceil(1 << 20) * 2 + 32;
    let res = Command::new(mkfs)
        .args(["-q", "-F", "-E", "lazy_itable_init=1", "-d"])
        .arg(rootfs)
        .arg(out)
        .arg(format!("{mib}M"))
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {}", mkfs.display()))?;
    if !res.status.success() {
        bail!(
            "{} -d {} failed ({}): {}",
            mkfs.display(),
            rootfs.display(),
            res.status,
            String::from_utf8_lossy(&res.stderr).trim()
        );
    }
    Ok(())
}

/// Everything one call needs, in its own temporary directory (removed on drop).
struct Setup {
    dir: tempfile::TempDir,
    qemu: PathBuf,
    kernel: GuestKernel,
    initrd: PathBuf,
    image: PathBuf,
}

impl Setup {
    fn new(rootfs: &Path, mode: InitMode) -> Result<Self> {
        let qemu = find_binary(QEMU).with_context(|| {
            format!("{QEMU} not installed: apt-get install qemu-system-x86 (or run scripts/up)")
        })?;
        let mkfs = find_binary("mkfs.ext4")
            .context("mkfs.ext4 not installed: apt-get install e2fsprogs")?;
        let kernel = GuestKernel::locate(Path::new(VM_DIR))?;
        let busybox = std::fs::read(BUSYBOX).with_context(|| {
            format!("cannot read {BUSYBOX}: apt-get install busybox-static (or run scripts/up)")
        })?;
        if !rootfs.join("bin/true").exists() && !rootfs.join("bin/true").is_symlink() {
            bail!("{} has no bin/true to run", rootfs.display());
        }
        let dir = tempfile::Builder::new().prefix("space-qemu-").tempdir()?;
        let initrd = dir.path().join("initramfs.cpio");
        std::fs::write(&initrd, build_initramfs(&kernel, &busybox, mode)?)
            .with_context(|| format!("cannot write {}", initrd.display()))?;
        let image = dir.path().join("rootfs.ext4");
        make_image(&mkfs, rootfs, &image)?;
        Ok(Self {
            dir,
            qemu,
            kernel,
            initrd,
            image,
        })
    }

    fn spec(&self, incoming: Option<String>, paused: bool) -> VmSpec {
        VmSpec {
            qemu: self.qemu.clone(),
            kernel: self.kernel.vmlinuz.clone(),
            initrd: self.initrd.clone(),
            image: self.image.clone(),
            qmp: Some(self.dir.path().join("qmp.sock")),
            incoming,
            paused,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Running QEMU.

/// One QEMU invocation. Source and destination of a migration must have the same devices, so
/// both come from here and differ only in `incoming`/`paused`.
#[derive(Debug, Clone)]
struct VmSpec {
    qemu: PathBuf,
    kernel: PathBuf,
    initrd: PathBuf,
    image: PathBuf,
    qmp: Option<PathBuf>,
    /// `-incoming <uri>`.
    incoming: Option<String>,
    /// `-S`: do not start the CPUs (a restore waits for `cont`).
    paused: bool,
}

impl VmSpec {
    fn args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = [
            // No PIT/PIC (the kernel uses the LAPIC timer), no option ROMs. ACPI stays on:
            // Debian's kernel finds the virtio-mmio devices through it. The RTC stays too:
            // without it the kernel waits twice for 1 s on the CMOS clock (boot p50 3.5 s -> 2.2 s).
            "-M",
            "microvm,x-option-roms=off,pit=off,pic=off,rtc=on",
            "-accel",
            "tcg",
            "-m",
            "256",
            "-smp",
            "1",
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
            "-serial",
            "stdio",
            "-append",
            KERNEL_CMDLINE,
        ]
        .iter()
        .map(OsString::from)
        .collect();
        a.push("-kernel".into());
        a.push(self.kernel.clone().into());
        a.push("-initrd".into());
        a.push(self.initrd.clone().into());
        let mut drive = OsString::from("id=root,format=raw,if=none,readonly=on,file=");
        drive.push(&self.image);
        a.push("-drive".into());
        a.push(drive);
        a.push("-device".into());
        a.push("virtio-blk-device,drive=root".into());
        if let Some(q) = &self.qmp {
            let mut s = OsString::from("unix:");
            s.push(q);
            s.push(",server=on,wait=off");
            a.push("-qmp".into());
            a.push(s);
        }
        if self.paused {
            a.push("-S".into());
        }
        if let Some(uri) = &self.incoming {
            a.push("-incoming".into());
            a.push(uri.into());
        }
        a
    }
}

/// What `/init` reports on the serial console.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Marker {
    Booted,
    Ready,
    Pong(String),
    Failed(String),
}

/// Reads one serial line (kernel messages and our markers share the console).
fn parse_marker(line: &str) -> Option<Marker> {
    let line = line.trim_end_matches(['\r', '\n']).trim_start();
    if line == BOOTED {
        Some(Marker::Booted)
    } else if line == READY {
        Some(Marker::Ready)
    } else if let Some(t) = line.strip_prefix(PONG) {
        Some(Marker::Pong(t.to_string()))
    } else {
        line.strip_prefix(FAILED)
            .map(|why| Marker::Failed(why.to_string()))
    }
}

/// A running QEMU: serial lines arrive on a channel from a reader thread, stderr is kept for
/// error messages. Killed and reaped on drop.
struct Vm {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Arc<Mutex<Vec<u8>>>,
    /// The last serial lines, for error messages.
    tail: Vec<String>,
}

impl Vm {
    fn spawn(spec: &VmSpec) -> Result<Self> {
        if let Some(q) = &spec.qmp {
            let _ = std::fs::remove_file(q);
        }
        let mut child = Command::new(&spec.qemu)
            .args(spec.args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {}", spec.qemu.display()))?;
        let stdout = child.stdout.take().context("no stdout pipe")?;
        let mut err_pipe = child.stderr.take().context("no stderr pipe")?;
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(stdout);
            let mut buf = Vec::new();
            while matches!(r.read_until(b'\n', &mut buf), Ok(n) if n > 0) {
                if tx.send(String::from_utf8_lossy(&buf).into_owned()).is_err() {
                    break;
                }
                buf.clear();
            }
        });
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            while let Ok(n) = err_pipe.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                let mut s = sink.lock().unwrap_or_else(|e| e.into_inner());
                if s.len() < 64 << 10 {
                    s.extend_from_slice(&chunk[..n]);
                }
            }
        });
        Ok(Self {
            stdin: child.stdin.take(),
            child,
            lines,
            stderr,
            tail: Vec::new(),
        })
    }

    /// Read serial lines until one parses to a marker `want` accepts. A `failed` marker, QEMU
    /// exiting or the deadline passing is an error that quotes what the guest and QEMU said.
    fn wait_for(&mut self, deadline: Instant, want: impl Fn(&Marker) -> bool) -> Result<()> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if self.tail.len() == 20 {
                        self.tail.remove(0);
                    }
                    self.tail.push(line.trim_end().to_string());
                    match parse_marker(&line) {
                        Some(m) if want(&m) => return Ok(()),
                        Some(Marker::Failed(why)) => {
                            return Err(self.explain(&format!("the guest's /init failed: {why}")));
                        }
                        _ => {}
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(self.explain(&format!(
                        "no answer from the guest within {} s",
                        STEP_TIMEOUT.as_secs()
                    )));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let status = self.wait_exit(Instant::now() + Duration::from_secs(2));
                    return Err(self.explain(&format!("QEMU exited ({status})")));
                }
            }
        }
    }

    fn explain(&self, what: &str) -> anyhow::Error {
        let stderr = self.stderr.lock().map(|s| s.clone()).unwrap_or_default();
        anyhow!(
            "{what}; QEMU stderr: {:?}; last serial lines: {:?}",
            String::from_utf8_lossy(&stderr).trim(),
            self.tail
        )
    }

    fn send_line(&mut self, line: &str) -> Result<()> {
        let stdin = self.stdin.as_mut().context("QEMU stdin is closed")?;
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .and_then(|()| stdin.flush())
            .context("cannot write to the guest's serial console")
    }

    /// Wait (bounded) for QEMU to exit; kill it when the deadline passes. Returns how it ended.
    fn wait_exit(&mut self, deadline: Instant) -> String {
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) => return st.to_string(),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                _ => {
                    let _ = self.child.kill();
                    return match self.child.wait() {
                        Ok(st) => format!("killed, {st}"),
                        Err(e) => format!("killed, wait failed: {e}"),
                    };
                }
            }
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A minimal QMP client: one command at a time, events skipped.
struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    /// Connect (QEMU creates the socket shortly after start), read the greeting and leave
    /// capabilities negotiation. Fails early if QEMU exits.
    fn connect(path: &Path, deadline: Instant, vm: &mut Vm) -> Result<Self> {
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) => {
                    if let Ok(Some(st)) = vm.child.try_wait() {
                        return Err(vm.explain(&format!("QEMU exited ({st}) before QMP was up")));
                    }
                    if Instant::now() > deadline {
                        return Err(vm.explain(&format!(
                            "no QMP socket at {} within {} s: {e}",
                            path.display(),
                            STEP_TIMEOUT.as_secs()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        };
        Self::handshake(stream, deadline)
    }

    fn handshake(stream: UnixStream, deadline: Instant) -> Result<Self> {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(100));
        stream.set_read_timeout(Some(left))?;
        let writer = stream.try_clone()?;
        let mut q = Self {
            reader: BufReader::new(stream),
            writer,
        };
        // QEMU can write an event before the greeting (as space-node's QMP client notes).
        let mut greeting = q.read_message()?;
        for _ in 0..16 {
            if greeting.get("event").is_none() {
                break;
            }
            greeting = q.read_message()?;
        }
        if greeting.get("QMP").is_none() {
            bail!("QMP greeting expected, got {greeting}");
        }
        q.execute("qmp_capabilities", None)?;
        Ok(q)
    }

    fn read_message(&mut self) -> Result<Value> {
        let mut line = String::new();
        if self
            .reader
            .read_line(&mut line)
            .context("reading from QMP")?
            == 0
        {
            bail!("QMP connection closed");
        }
        serde_json::from_str(&line).with_context(|| format!("QMP sent invalid JSON: {line:?}"))
    }

    /// Run `cmd`; its `return` value, or an error carrying QEMU's class and description.
    fn execute(&mut self, cmd: &str, args: Option<Value>) -> Result<Value> {
        let mut req = json!({ "execute": cmd });
        if let Some(a) = args {
            req["arguments"] = a;
        }
        let mut bytes = serde_json::to_vec(&req)?;
        bytes.push(b'\n');
        self.writer
            .write_all(&bytes)
            .with_context(|| format!("sending QMP {cmd}"))?;
        loop {
            let msg = self.read_message().with_context(|| format!("QMP {cmd}"))?;
            if let Some(r) = msg.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = msg.get("error") {
                bail!(
                    "QMP {cmd} failed: {} ({})",
                    e.get("desc")
                        .and_then(Value::as_str)
                        .unwrap_or("no description"),
                    e.get("class").and_then(Value::as_str).unwrap_or("no class")
                );
            }
            // An event ({"event": ...}); not what we wait for.
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parse a newc archive back into (name, mode, rdev, data) entries, checking alignment.
    /// (name, mode, (rdevmajor, rdevminor), data)
    type Entry = (String, u32, (u32, u32), Vec<u8>);

    fn parse_newc(mut b: &[u8]) -> Vec<Entry> {
        let total = b.len();
        let mut out = Vec::new();
        loop {
            let hex = |i: usize| {
                u32::from_str_radix(std::str::from_utf8(&b[6 + i * 8..14 + i * 8]).unwrap(), 16)
                    .unwrap()
            };
            assert_eq!(&b[..6], b"070701");
            let (mode, size, rmaj, rmin, namesize) =
                (hex(1), hex(6) as usize, hex(9), hex(10), hex(11) as usize);
            let name = std::str::from_utf8(&b[110..110 + namesize - 1])
                .unwrap()
                .to_string();
            assert_eq!(b[110 + namesize - 1], 0, "name is NUL-terminated");
            let data_at = (110 + namesize).div_ceil(4) * 4;
            let data = b[data_at..data_at + size].to_vec();
            let next = (data_at + size).div_ceil(4) * 4;
            b = &b[next.min(b.len())..];
            if name == "TRAILER!!!" {
                assert!(b.is_empty(), "nothing after the trailer");
                assert_eq!(total % 4, 0);
                return out;
            }
            out.push((name, mode, (rmaj, rmin), data));
        }
    }

    #[test]
    fn cpio_writer_round_trips_and_aligns() {
        let mut c = Cpio::new(Vec::new());
        c.dir("bin").unwrap();
        c.file("bin/x", 0o755, b"hello").unwrap();
        c.char_dev("dev/console", 0o600, 5, 1).unwrap();
        c.file("a", 0o644, b"").unwrap();
        let bytes = c.finish().unwrap();
        // The first header, field by field: magic, ino 1, mode 040755, ..., namesize 4.
        assert!(bytes.starts_with(b"07070100000001000041ed"));
        let entries = parse_newc(&bytes);
        let names: Vec<_> = entries.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(names, ["bin", "bin/x", "dev/console", "a"]);
        assert_eq!(entries[1].1, S_IFREG | 0o755);
        assert_eq!(entries[1].3, b"hello");
        assert_eq!(entries[2].1, S_IFCHR | 0o600);
        assert_eq!(entries[2].2, (5, 1));
        assert!(entries[3].3.is_empty());
    }

    const DEP: &str = "kernel/drivers/virtio/virtio_ring.ko:\n\
        kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko\n\
        kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n\
        kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n\
        kernel/drivers/char/hw_random/virtio-rng.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n";

    #[test]
    fn load_order_puts_dependencies_first_once_and_skips_builtins() {
        let builtin = "kernel/fs/ext4/ext4.ko\nkernel/fs/jbd2/jbd2.ko\n";
        let order = load_order(
            DEP,
            builtin,
            &["virtio_mmio", "virtio_blk", "ext4", "virtio-rng"],
        )
        .unwrap();
        assert_eq!(
            order,
            [
                "kernel/drivers/virtio/virtio_ring.ko",
                "kernel/drivers/virtio/virtio.ko",
                "kernel/drivers/virtio/virtio_mmio.ko",
                "kernel/drivers/block/virtio_blk.ko",
                "kernel/drivers/char/hw_random/virtio-rng.ko",
            ]
        );
    }

    #[test]
    fn load_order_names_a_missing_module() {
        let err = load_order(DEP, "", &["ext4"]).unwrap_err().to_string();
        assert!(err.contains("ext4") && err.contains("scripts/up"), "{err}");
        let err = load_order("garbage line", "", &["x"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("without ':'"), "{err}");
    }

    #[test]
    fn init_script_loads_modules_in_order_then_runs_true() {
        let mods = vec![
            "kernel/drivers/virtio/virtio_ring.ko".to_string(),
            "kernel/drivers/block/virtio_blk.ko".to_string(),
        ];
        let boot = init_script("6.1.0-x", &mods, InitMode::Boot);
        assert!(boot.starts_with("#!/bin/busybox sh\n"));
        let ring = boot
            .find("insmod /lib/modules/6.1.0-x/kernel/drivers/virtio/virtio_ring.ko")
            .unwrap();
        let blk = boot
            .find("insmod /lib/modules/6.1.0-x/kernel/drivers/block/virtio_blk.ko")
            .unwrap();
        let mount = boot.find("mount -t ext4 -o ro /dev/vda /newroot").unwrap();
        let run = boot.find("chroot /newroot /bin/true").unwrap();
        let booted = boot.find(BOOTED).unwrap();
        assert!(ring < blk && blk < mount && mount < run && run < booted);
        assert!(boot.trim_end().ends_with("poweroff -f"));
        assert!(!boot.contains(READY));

        let ready = init_script("6.1.0-x", &mods, InitMode::Ready);
        assert!(
            ready.contains(READY)
                && ready.contains("while read -r line; do echo \"space-bench: pong $line\"")
        );
        assert!(!ready.contains(BOOTED));
    }

    #[test]
    fn markers_parse_from_serial_lines() {
        assert_eq!(
            parse_marker("space-bench: booted\r\n"),
            Some(Marker::Booted)
        );
        assert_eq!(parse_marker("space-bench: ready\n"), Some(Marker::Ready));
        assert_eq!(
            parse_marker("space-bench: pong ping-3\r\n"),
            Some(Marker::Pong("ping-3".into()))
        );
        assert_eq!(
            parse_marker("space-bench: failed mount /dev/vda\n"),
            Some(Marker::Failed("mount /dev/vda".into()))
        );
        assert_eq!(parse_marker("[    4.1] EXT4-fs (vda): mounted\n"), None);
        assert_eq!(
            parse_marker("ping-3\n"),
            None,
            "a tty echo of the ping is not an answer"
        );
        assert_eq!(parse_marker("space-bench: booted later\n"), None);
    }

    fn spec(incoming: Option<&str>, paused: bool) -> VmSpec {
        VmSpec {
            qemu: "/usr/bin/qemu-system-x86_64".into(),
            kernel: "/vm/vmlinuz".into(),
            initrd: "/tmp/t/initramfs.cpio".into(),
            image: "/tmp/t/rootfs.ext4".into(),
            qmp: Some("/tmp/t/qmp.sock".into()),
            incoming: incoming.map(str::to_string),
            paused,
        }
    }

    fn after<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
        args.iter()
            .position(|a| a == flag)
            .map(|i| args[i + 1].as_str())
    }

    #[test]
    fn command_line_is_a_tcg_microvm_with_a_readonly_virtio_disk() {
        let args: Vec<String> = spec(None, false)
            .args()
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect();
        assert!(after(&args, "-M").unwrap().starts_with("microvm,"));
        assert_eq!(after(&args, "-accel"), Some("tcg"));
        assert_eq!(after(&args, "-kernel"), Some("/vm/vmlinuz"));
        assert_eq!(after(&args, "-initrd"), Some("/tmp/t/initramfs.cpio"));
        assert_eq!(
            after(&args, "-drive"),
            Some("id=root,format=raw,if=none,readonly=on,file=/tmp/t/rootfs.ext4")
        );
        assert_eq!(
            after(&args, "-device"),
            Some("virtio-blk-device,drive=root")
        );
        assert_eq!(
            after(&args, "-qmp"),
            Some("unix:/tmp/t/qmp.sock,server=on,wait=off")
        );
        assert_eq!(after(&args, "-serial"), Some("stdio"));
        let append = after(&args, "-append").unwrap();
        assert!(append.contains("console=ttyS0") && append.contains("tsc_early_khz=2000000"));
        assert!(
            args.contains(&"-nodefaults".to_string()) && args.contains(&"-no-reboot".to_string())
        );
        assert!(!args.contains(&"-S".to_string()) && after(&args, "-incoming").is_none());
    }

    #[test]
    fn restore_command_line_differs_only_by_incoming_and_paused() {
        let boot: Vec<OsString> = spec(None, false).args();
        let restore: Vec<OsString> = spec(Some("exec:cat /tmp/t/state"), true).args();
        assert_eq!(
            &restore[..boot.len()],
            &boot[..],
            "same machine and devices as the source"
        );
        assert_eq!(
            &restore[boot.len()..],
            ["-S", "-incoming", "exec:cat /tmp/t/state"].map(OsString::from)
        );
    }

    #[test]
    fn migration_uris_refuse_shell_metacharacters() {
        assert_eq!(
            outgoing_uri(Path::new("/tmp/space-qemu-x1/state")).unwrap(),
            "exec:cat > /tmp/space-qemu-x1/state"
        );
        assert_eq!(
            incoming_uri(Path::new("/tmp/a/state")).unwrap(),
            "exec:cat /tmp/a/state"
        );
        for bad in ["/tmp/a b/state", "/tmp/$(x)", "/tmp/a;rm", ""] {
            let err = incoming_uri(Path::new(bad)).unwrap_err().to_string();
            assert!(err.contains("characters outside"), "{bad}: {err}");
        }
    }

    #[test]
    fn n_is_bounded() {
        let e = qemu_boot(Path::new("/nonexistent"), 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("between 1 and 1000"), "{e}");
        let e = qemu_restore(Path::new("/nonexistent"), MAX_N + 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("between 1 and 1000"), "{e}");
    }

    #[test]
    fn guest_kernel_missing_points_at_scripts_up() {
        let d = tempfile::tempdir().unwrap();
        let e = GuestKernel::locate(d.path()).unwrap_err().to_string();
        assert!(e.starts_with("guest kernel missing: run scripts/up"), "{e}");
    }

    /// A fake QEMU on the other end of a socket pair: greeting, capabilities, an event before
    /// a return, and an error.
    #[test]
    fn qmp_client_skips_events_and_reports_errors() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let fake = std::thread::spawn(move || {
            let mut r = BufReader::new(theirs.try_clone().unwrap());
            let mut w = theirs;
            let mut line = String::new();
            w.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
                .unwrap();
            let mut seen = Vec::new();
            for reply in [
                "{\"return\": {}}\n",
                "{\"event\": \"STOP\", \"timestamp\": {}}\n{\"return\": {\"status\": \"paused\"}}\n",
                "{\"error\": {\"class\": \"GenericError\", \"desc\": \"no such thing\"}}\n",
            ] {
                line.clear();
                r.read_line(&mut line).unwrap();
                seen.push(serde_json::from_str::<Value>(&line).unwrap());
                w.write_all(reply.as_bytes()).unwrap();
            }
            seen
        });
        let mut q = Qmp::handshake(ours, Instant::now() + Duration::from_secs(10)).unwrap();
        let st = q.execute("query-status", None).unwrap();
        assert_eq!(st["status"], "paused");
        let err = q
            .execute("migrate", Some(json!({"uri": "exec:cat > /x"})))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "QMP migrate failed: no such thing (GenericError)");
        let seen = fake.join().unwrap();
        assert_eq!(seen[0], json!({"execute": "qmp_capabilities"}));
        assert_eq!(
            seen[2],
            json!({"execute": "migrate", "arguments": {"uri": "exec:cat > /x"}})
        );
    }

    /// Boots and restores a real VM when QEMU and the guest kernel are installed. Where they
    /// are not, it fails with the setup hint if SPACE_REQUIRE_QEMU=1 (CI, after scripts/test
    /// installed them) and otherwise says why it did nothing.
    #[test]
    fn boots_and_restores_a_real_microvm() {
        let missing = if find_binary(QEMU).is_none() {
            Some(format!(
                "{QEMU} not installed: apt-get install qemu-system-x86"
            ))
        } else if let Err(e) = GuestKernel::locate(Path::new(VM_DIR)) {
            Some(e.to_string())
        } else if !Path::new(BUSYBOX).is_file() {
            Some(format!("{BUSYBOX} missing: apt-get install busybox-static"))
        } else {
            None
        };
        if let Some(why) = missing {
            if std::env::var("SPACE_REQUIRE_QEMU").as_deref() == Ok("1") {
                panic!("SPACE_REQUIRE_QEMU=1 but {why}");
            }
            eprintln!(
                "skipping the real QEMU boot: {why} (set SPACE_REQUIRE_QEMU=1 to require it)"
            );
            return;
        }
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("bin")).unwrap();
        std::fs::copy(BUSYBOX, root.path().join("bin/busybox")).unwrap();
        std::os::unix::fs::symlink("busybox", root.path().join("bin/true")).unwrap();

        let boot = qemu_boot(root.path(), 1).unwrap();
        assert_eq!(boot.len(), 1);
        assert!(
            boot[0] > 0.0 && boot[0] < STEP_TIMEOUT.as_secs_f64() * 1000.0,
            "{boot:?}"
        );
        let restore = qemu_restore(root.path(), 2).unwrap();
        assert_eq!(restore.len(), 2);
        assert!(restore.iter().all(|&s| s > 0.0), "{restore:?}");

        // A rootfs whose /bin/true fails makes /init report it instead of timing out.
        std::fs::remove_file(root.path().join("bin/true")).unwrap();
        std::os::unix::fs::symlink("/bin/busybox-missing", root.path().join("bin/true")).unwrap();
        let err = format!("{:#}", qemu_boot(root.path(), 1).unwrap_err());
        assert!(err.contains("/bin/true in the rootfs"), "{err}");
    }
}
