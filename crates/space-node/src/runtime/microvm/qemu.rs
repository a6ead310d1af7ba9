//! Running QEMU: the command line, spawning it in its own process group, waiting (bounded)
//! until QMP answers and the guest serves its channel, the KVM probe, and /proc helpers.

use std::ffi::OsString;
use std::fs;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::fd::BorrowedFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use space_sys::jail::JailSpec;
use space_sys::ns;

use super::qmp::{Qmp, QmpError};
use super::{CHANNEL_PORT, FAILED_MARKER, READY_MARKER};

/// The kernel command line of the guest contract (see the module documentation).
pub const KERNEL_CMDLINE: &str = "console=ttyS0 panic=-1 quiet rdinit=/init SPACE_GUEST=vm";
/// Added under TCG: the emulated TSC cannot be calibrated quickly against a (missing) PIT.
pub const TCG_CMDLINE: &str = "tsc_early_khz=2000000";
/// `-accel` under TCG: the translation cache is [`super::jail::TCG_TB_MIB`] MiB.
pub const TCG_ACCEL: &str = "tcg,tb-size=64";
/// QEMU's id of the virtio-serial port; `VSERPORT_CHANGE` events name it.
pub const PORT_DEVICE_ID: &str = "space0";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccelKind {
    Kvm,
    Tcg,
}

impl AccelKind {
    pub fn as_str(self) -> &'static str {
        match self {
            AccelKind::Kvm => "kvm",
            AccelKind::Tcg => "tcg",
        }
    }
}

/// One QEMU invocation for one sandbox.
#[derive(Debug, Clone)]
pub struct VmSpec {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub accel: AccelKind,
    pub memory_mib: u64,
    pub vcpus: u32,
    pub disk: PathBuf,
    pub channel_socket: PathBuf,
    /// Where the node keeps the serial console (`console.rs`).
    pub console: PathBuf,
    /// The node's socket the serial chardev connects to.
    pub console_socket: PathBuf,
    pub qmp: PathBuf,
    /// The guest NIC's MAC address (locally administered, from the sandbox id).
    pub mac: [u8; 6],
}

/// A path inside a QEMU option string: commas are doubled (QemuOpts' escape).
fn opt_path(prefix: &str, p: &Path) -> OsString {
    let mut s = OsString::from(prefix);
    let raw = p.as_os_str().to_string_lossy();
    if raw.contains(',') {
        s.push(raw.replace(',', ",,"));
    } else {
        s.push(p.as_os_str());
    }
    s
}

pub fn kernel_cmdline(accel: AccelKind) -> String {
    match accel {
        AccelKind::Tcg => format!("{KERNEL_CMDLINE} {TCG_CMDLINE}"),
        AccelKind::Kvm => KERNEL_CMDLINE.to_owned(),
    }
}

/// What a QEMU gets beyond its [`VmSpec`]: file-backed guest RAM and an incoming migration
/// (see `checkpoint.rs`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Extras<'a> {
    /// Guest RAM in this file (`memory-backend-file`, `share=on`), not anonymous memory.
    pub memory_file: Option<&'a Path>,
    /// Start paused, waiting for `migrate-incoming` (`-incoming defer`).
    pub incoming: bool,
    /// Map `memory_file` privately (`share=off`): guest writes go to the VM's own anonymous
    /// pages and the file (a reflink of a checkpoint's memory) is only read.
    pub private_memory: bool,
    /// A tap device (an open descriptor QEMU inherits at this number): the guest gets a
    /// virtio-net NIC on it. Every VM the node starts has one, so checkpoints and the VMs
    /// restored from them have the same devices.
    pub tap_fd: Option<std::os::fd::RawFd>,
}

/// The id of the file memory backend.
pub const MEMORY_BACKEND_ID: &str = "ram0";

impl VmSpec {
    #[cfg(test)]
    pub fn args(&self) -> Vec<OsString> {
        self.args_with(Extras::default())
    }

    pub fn args_with(&self, extras: Extras<'_>) -> Vec<OsString> {
        let mut a: Vec<OsString> = Vec::new();
        fn push(a: &mut Vec<OsString>, items: &[&str]) {
            a.extend(items.iter().map(OsString::from));
        }
        // No PIT/PIC (the kernel uses the LAPIC timer), no option ROMs. ACPI stays on:
        // Debian's kernel finds the virtio-mmio devices through it. The RTC stays too:
        // without it the kernel waits twice for 1 s on the CMOS clock.
        let machine = match extras.memory_file {
            Some(_) => format!(
                "microvm,x-option-roms=off,pit=off,pic=off,rtc=on,memory-backend={MEMORY_BACKEND_ID}"
            ),
            None => "microvm,x-option-roms=off,pit=off,pic=off,rtc=on".to_owned(),
        };
        push(&mut a, &["-M", &machine]);
        push(
            &mut a,
            &[
                "-accel",
                // Under TCG the translation cache is bounded (QEMU's default grows towards
                // 1 GiB), so the jail's memory cgroup can account for it.
                match self.accel {
                    AccelKind::Kvm => "kvm",
                    AccelKind::Tcg => TCG_ACCEL,
                },
                "-cpu",
                match self.accel {
                    AccelKind::Kvm => "host",
                    AccelKind::Tcg => "max",
                },
            ],
        );
        let (mem, smp) = (self.memory_mib.to_string(), self.vcpus.to_string());
        push(&mut a, &["-m", &mem, "-smp", &smp]);
        if let Some(file) = extras.memory_file {
            // share=on: guest writes land in the file's pages, so x-ignore-shared migration
            // leaves RAM out of the state and a copy of the file is the RAM. share=off: the
            // file is the starting RAM, demand-paged; writes stay the VM's own.
            let share = if extras.private_memory { "off" } else { "on" };
            a.push("-object".into());
            a.push(opt_path(
                &format!(
                    "memory-backend-file,id={MEMORY_BACKEND_ID},size={}M,share={share},mem-path=",
                    self.memory_mib
                ),
                file,
            ));
        }
        push(
            &mut a,
            &[
                "-nodefaults",
                "-no-user-config",
                // Not -nographic: that muxes a monitor onto stdio, which is our log file.
                "-display",
                "none",
                "-no-reboot",
                "-sandbox",
                "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
            ],
        );
        a.push("-kernel".into());
        a.push(self.kernel.clone().into());
        a.push("-initrd".into());
        a.push(self.initrd.clone().into());
        a.push("-append".into());
        a.push(kernel_cmdline(self.accel).into());
        // writeback: the host page cache, with the guest's flushes passed on as fdatasync, so
        // what the guest fsyncs is durable (unsafe would drop flushes; none means O_DIRECT,
        // which btrfs serves poorly and checksums badly when buffers change in flight).
        // discard=unmap lets a guest trim punch holes into its reflinked image.
        a.push("-drive".into());
        a.push(opt_path(
            "id=root,format=raw,if=none,cache=writeback,discard=unmap,file=",
            &self.disk,
        ));
        push(&mut a, &["-device", "virtio-blk-device,drive=root"]);
        push(&mut a, &["-device", "virtio-serial-device,max_ports=2"]);
        a.push("-chardev".into());
        a.push(opt_path(
            "socket,id=ch0,server=on,wait=off,path=",
            &self.channel_socket,
        ));
        a.push("-device".into());
        a.push(
            format!("virtserialport,chardev=ch0,id={PORT_DEVICE_ID},name={CHANNEL_PORT}").into(),
        );
        if let Some(fd) = extras.tap_fd {
            push(&mut a, &["-netdev", &format!("tap,id=net0,fd={fd}")]);
            let m = self.mac;
            push(
                &mut a,
                &[
                    "-device",
                    &format!(
                        "virtio-net-device,netdev=net0,mac={:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
                        m[0], m[1], m[2], m[3], m[4], m[5]
                    ),
                ],
            );
        }
        // Chardevs rather than -serial file: / -qmp unix:, whose legacy syntax has no escape
        // for commas in paths.
        // The serial console goes to the node, which bounds what it keeps (a `file` chardev
        // would grow as long as the guest writes).
        a.push("-chardev".into());
        a.push(opt_path("socket,id=con,path=", &self.console_socket));
        push(&mut a, &["-serial", "chardev:con"]);
        a.push("-chardev".into());
        a.push(opt_path(
            "socket,id=qmp,server=on,wait=off,path=",
            &self.qmp,
        ));
        push(&mut a, &["-mon", "chardev=qmp,mode=control"]);
        if extras.incoming {
            push(&mut a, &["-incoming", "defer"]);
        }
        a
    }
}

/// Spawns QEMU in its own process group (a signal to the node's group, Ctrl-C included, does
/// not reach it; a node restart leaves it running), stdin from /dev/null, stdout and stderr
/// appended to `log`.
pub fn spawn(qemu: &Path, args: &[OsString], log: &Path) -> io::Result<Child> {
    spawn_with(qemu, args, log, None, Vec::new())
}

/// [`spawn`], jailed as `jail` says when given (see `jail.rs`): the environment is cleared
/// too, so nothing of the node's reaches QEMU. QEMU inherits `inherit` at their numbers.
pub fn spawn_with(
    qemu: &Path,
    args: &[OsString],
    log: &Path,
    jail: Option<JailSpec<'_>>,
    inherit: Vec<std::os::fd::OwnedFd>,
) -> io::Result<Child> {
    let out = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| io::Error::new(e.kind(), format!("cannot open {}: {e}", log.display())))?;
    let mut cmd = Command::new(qemu);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .process_group(0);
    if let Some(jail) = jail {
        cmd.env_clear();
        space_sys::jail::jail_command(&mut cmd, jail)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    }
    if !inherit.is_empty() {
        space_sys::jail::inherit_fds(&mut cmd, inherit);
    }
    cmd.spawn().map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "cannot start {}: {e}; it said: {:?}",
                qemu.display(),
                tail_of(log, 512)
            ),
        )
    })
}

/// How far a launch got, for the log.
#[derive(Debug, Clone, Copy)]
pub struct BootTimes {
    /// How long the spawn itself took (fork, the jail's setup, exec); the times below count
    /// from its end.
    pub spawn: Duration,
    pub qmp_ready: Duration,
    pub guest_ready: Duration,
    /// "console" (the guest's marker) or "port" (QEMU saw the guest open the channel port).
    pub ready_by: &'static str,
}

/// The end of a file (at most `max` bytes), for error messages.
pub fn tail_of(path: &Path, max: u64) -> String {
    let Ok(mut f) = fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut buf = Vec::new();
    let _ = f.take(max).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).trim().to_owned()
}

/// Follows the serial console file as QEMU writes it.
#[derive(Debug)]
pub struct ConsoleTail {
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
    pub last: Vec<String>,
    /// The last lines that are not kernel messages, or that report a kernel panic.
    pub notable: Vec<String>,
}

/// What the guest said on its console.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Marker {
    Ready,
    Failed(String),
}

pub fn parse_marker(line: &str) -> Option<Marker> {
    let line = line.trim_end_matches(['\r', '\n']).trim_start();
    if line == READY_MARKER {
        Some(Marker::Ready)
    } else {
        line.strip_prefix(FAILED_MARKER)
            .map(|why| Marker::Failed(why.trim().to_owned()))
    }
}

impl ConsoleTail {
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            offset: 0,
            partial: Vec::new(),
            last: Vec::new(),
            notable: Vec::new(),
        }
    }

    /// Reads what was added since the last call; the first marker among the new lines.
    pub fn poll(&mut self) -> Option<Marker> {
        let Ok(mut f) = fs::File::open(&self.path) else {
            return None;
        };
        // Shorter than what was read: the node rotated it (`console.rs`), this is a new file.
        if f.metadata().is_ok_and(|m| m.len() < self.offset) {
            self.offset = 0;
        }
        if f.seek(SeekFrom::Start(self.offset)).is_err() {
            return None;
        }
        let mut buf = Vec::new();
        // At most 1 MiB a poll: a guest flooding its console cannot make us buffer it all.
        let n = f.take(1 << 20).read_to_end(&mut buf).unwrap_or(0);
        self.offset += n as u64;
        self.partial.extend_from_slice(&buf[..n]);
        let mut found = None;
        while let Some(end) = self.partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line).trim_end().to_owned();
            if found.is_none() {
                found = parse_marker(&line);
            }
            if !line.starts_with('[') || line.contains("Kernel panic") {
                if self.notable.len() == 10 {
                    self.notable.remove(0);
                }
                self.notable.push(line.clone());
            }
            if self.last.len() == 20 {
                self.last.remove(0);
            }
            self.last.push(line);
        }
        if self.partial.len() > 4096 {
            self.partial.clear();
        }
        found
    }

    /// The lines worth showing: what the guest's own programs printed and the kernel's
    /// panic line (kernel backtraces crowd them out of a plain tail), then the last 3 lines.
    pub fn describe(&self) -> String {
        if self.last.is_empty() && self.notable.is_empty() {
            return "the console is empty".to_owned();
        }
        let tail = &self.last[self.last.len().saturating_sub(3)..];
        format!("console: {:?}, ending {:?}", self.notable, tail)
    }
}

/// Whether the child behind `pidfd` exited (reaping it); its raw status.
pub fn exited(pidfd: BorrowedFd<'_>) -> Option<i32> {
    match ns::waitid_pidfd(pidfd, libc::WNOHANG) {
        Ok(Some(st)) => Some(st),
        Ok(None) => None,
        // ECHILD: reaped elsewhere; gone all the same.
        Err(_) => Some(-1),
    }
}

/// Waits until QMP answers `query-status` with `running` and the channel socket exists, then
/// until the guest serves its channel: [`READY_MARKER`] on the console or a `VSERPORT_CHANGE`
/// event opening [`PORT_DEVICE_ID`]. Err: why not, with the console's and QEMU's last words.
pub fn wait_ready(
    pidfd: BorrowedFd<'_>,
    qmp_path: &Path,
    channel: &Path,
    console: &Path,
    log: &Path,
    timeout: Duration,
) -> Result<BootTimes, String> {
    let t0 = Instant::now();
    let deadline = t0 + timeout;
    let mut con = ConsoleTail::new(console);
    let died = |st: i32, con: &mut ConsoleTail| {
        con.poll();
        format!(
            "QEMU exited (status {st}) during boot; {}; QEMU said: {:?}",
            con.describe(),
            tail_of(log, 2048)
        )
    };
    let timed_out = |what: &str, con: &mut ConsoleTail| {
        con.poll();
        format!(
            "{what} within {} s; {}; QEMU said: {:?}",
            timeout.as_secs_f64(),
            con.describe(),
            tail_of(log, 2048)
        )
    };
    let mut pause = Duration::from_millis(1);
    let mut qmp = loop {
        if let Some(st) = exited(pidfd) {
            return Err(died(st, &mut con));
        }
        match Qmp::connect(qmp_path, deadline.saturating_duration_since(Instant::now())) {
            Ok(q) => break q,
            Err(QmpError::Connect { .. }) if Instant::now() < deadline => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(20));
            }
            Err(e) => return Err(timed_out(&format!("QMP did not answer ({e})"), &mut con)),
        }
    };
    match qmp.status(deadline) {
        Ok(s) if s == "running" => {}
        Ok(s) => return Err(format!("the VM is {s:?} right after start, not running")),
        Err(e) => return Err(timed_out(&format!("query-status failed ({e})"), &mut con)),
    }
    if !channel.exists() {
        return Err(format!(
            "QEMU answers QMP but created no channel socket at {}",
            channel.display()
        ));
    }
    let qmp_ready = t0.elapsed();
    loop {
        match con.poll() {
            Some(Marker::Ready) => {
                return Ok(BootTimes {
                    spawn: Duration::ZERO,
                    qmp_ready,
                    guest_ready: t0.elapsed(),
                    ready_by: "console",
                });
            }
            Some(Marker::Failed(why)) => {
                return Err(format!("the guest init failed: {why}; {}", con.describe()));
            }
            None => {}
        }
        if qmp.events.drain(..).any(|e| port_opened(&e)) {
            return Ok(BootTimes {
                spawn: Duration::ZERO,
                qmp_ready,
                guest_ready: t0.elapsed(),
                ready_by: "port",
            });
        }
        if let Some(st) = exited(pidfd) {
            return Err(died(st, &mut con));
        }
        if Instant::now() >= deadline {
            return Err(timed_out(
                "the guest did not report serving its channel",
                &mut con,
            ));
        }
        // Wait on QMP for up to 20 ms (an event ends the wait early), then look again.
        match qmp.read_message((Instant::now() + Duration::from_millis(20)).min(deadline)) {
            Ok(Some(msg)) if msg.get("event").is_some() => qmp.events.push(msg),
            Ok(_) => {}
            // QEMU closed QMP: it is exiting; the next round sees the exit.
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// `{"event": "VSERPORT_CHANGE", "data": {"id": "space0", "open": true}}`.
pub fn port_opened(event: &Value) -> bool {
    event.get("event").and_then(Value::as_str) == Some("VSERPORT_CHANGE")
        && event.pointer("/data/id").and_then(Value::as_str) == Some(PORT_DEVICE_ID)
        && event.pointer("/data/open").and_then(Value::as_bool) == Some(true)
}

/// Boots the guest kernel under KVM without an initramfs (it panics at once, failing to
/// mount a root) and checks that it got there: QEMU exits cleanly within `timeout` with a
/// kernel panic on the console. Err: why KVM is unusable.
pub fn probe_kvm(qemu: &Path, kernel: &Path, work: &Path, timeout: Duration) -> Result<(), String> {
    if let Err(e) = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        return Err(format!("cannot open /dev/kvm: {e}"));
    }
    let console = work.join("kvm-probe.console");
    let log = work.join("kvm-probe.log");
    let _ = fs::remove_file(&console);
    let _ = fs::remove_file(&log);
    let mut args: Vec<OsString> = [
        "-M",
        "microvm,x-option-roms=off,pit=off,pic=off,rtc=on",
        "-accel",
        "kvm",
        "-cpu",
        "host",
        "-m",
        "128",
        "-smp",
        "1",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
        "-append",
        "console=ttyS0 panic=-1 quiet root=/dev/space-kvm-probe",
        "-serial",
        "chardev:con",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    args.push("-kernel".into());
    args.push(kernel.into());
    args.push("-chardev".into());
    args.push(opt_path("file,id=con,path=", &console));
    let mut child = spawn(qemu, &args, &log).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "a KVM guest did not reach its kernel's first panic within {} s \
                     (nested or emulated KVM too slow); QEMU said: {:?}",
                    timeout.as_secs_f64(),
                    tail_of(&log, 512)
                ));
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("cannot wait for the KVM probe: {e}"));
            }
        }
    };
    let said = fs::read_to_string(&console).unwrap_or_default();
    if status.success() && said.contains("Kernel panic") {
        Ok(())
    } else {
        Err(format!(
            "a KVM guest failed ({status}); QEMU said: {:?}",
            tail_of(&log, 512)
        ))
    }
}

/// What `/proc/PID/stat` says about a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    pub state: char,
    pub start_time: u64,
}

pub fn parse_stat(s: &str) -> Option<ProcStat> {
    // comm (field 2) may hold spaces and parentheses: fields restart after the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // After the state (field 3), field 22 is the 19th.
    let start_time = fields.nth(18)?.parse().ok()?;
    Some(ProcStat { state, start_time })
}

pub fn read_stat(pid: u32) -> io::Result<ProcStat> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    parse_stat(&s).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "malformed stat"))
}
