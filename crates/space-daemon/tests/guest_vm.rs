//! space-daemon as the init of a real QEMU `microvm` (issue 6): an initramfs with the static
//! daemon as `/init` and the virtio modules, a busybox ext4 disk, the channel on the
//! virtio-serial port `space.0` behind a unix socket. Calls Info and Exec, disconnects (also in
//! the middle of a stream), reconnects and calls again. Prints the boot-to-first-Info time.
//!
//! Needs QEMU, the guest kernel (scripts/up), busybox-static, mkfs.ext4 and a static daemon:
//!   RUSTFLAGS="-C target-feature=+crt-static" cargo build -p space-daemon --release \
//!       --target x86_64-unknown-linux-gnu
//!   SPACE_REQUIRE_QEMU=1 cargo test -p space-daemon --test guest_vm -- --nocapture
//! Without SPACE_REQUIRE_QEMU=1 it says so and does nothing (plain `cargo test` stays fast).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use hyper_util::rt::TokioIo;
use space_proto::guest_client::GuestClient;
use space_proto::process_event::Event;
use space_proto::*;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

const VM_DIR: &str = "/usr/local/lib/space/vm";
const MODULES: &[&str] = &[
    "kernel/drivers/virtio/virtio_ring.ko",
    "kernel/drivers/virtio/virtio.ko",
    "kernel/drivers/virtio/virtio_mmio.ko",
    "kernel/drivers/block/virtio_blk.ko",
    "kernel/drivers/char/virtio_console.ko",
];
const CMDLINE: &str =
    "console=ttyS0 panic=-1 quiet rdinit=/init SPACE_GUEST=vm tsc_early_khz=2000000";

fn static_daemon() -> Result<PathBuf> {
    // SPACE_DAEMON_STATIC, else the one scripts/test builds (SPACE_DAEMON_BINARY), else a
    // release build, else a debug build in the workspace's target dir.
    let target =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/x86_64-unknown-linux-gnu");
    let p = std::env::var_os("SPACE_DAEMON_STATIC")
        .or_else(|| std::env::var_os("SPACE_DAEMON_BINARY"))
        .map(PathBuf::from)
        .or_else(|| {
            ["release", "debug"]
                .iter()
                .map(|m| target.join(m).join("space-daemon"))
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| target.join("release/space-daemon"));
    let bin = std::fs::read(&p).with_context(|| {
        format!(
            "no static daemon at {} (RUSTFLAGS=\"-C target-feature=+crt-static\" cargo build \
             -p space-daemon --release --target x86_64-unknown-linux-gnu, or set \
             SPACE_DAEMON_STATIC)",
            p.display()
        )
    })?;
    // A dynamic executable names its loader (PT_INTERP); a static one does not.
    let u16_at = |o: usize| u16::from_le_bytes([bin[o], bin[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(bin[0x20..0x28].try_into()?) as usize;
    let interp = (0..u16_at(0x38)).any(|i| {
        let o = phoff + i * u16_at(0x36);
        bin[o..o + 4] == 3u32.to_le_bytes() // PT_INTERP
    });
    if !bin.starts_with(b"\x7fELF") || interp {
        bail!(
            "{} is dynamically linked; build it with +crt-static",
            p.display()
        );
    }
    Ok(p)
}

/// newc cpio, what the kernel unpacks as initramfs.
struct Cpio {
    out: Vec<u8>,
    ino: u32,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
        self.ino += 1;
        let nlink = if mode & 0o170000 == 0o040000 { 2 } else { 1 };
        let h = format!(
            "070701{:08x}{mode:08x}{:08x}{:08x}{nlink:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.ino,
            0,
            0,
            0,
            data.len(),
            0,
            0,
            rdev.0,
            rdev.1,
            name.len() + 1,
            0
        );
        self.out.extend_from_slice(h.as_bytes());
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }
    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }
}

fn initramfs(daemon: &Path, version: &str) -> Result<Vec<u8>> {
    let mut c = Cpio {
        out: Vec::new(),
        ino: 0,
    };
    for d in ["dev", "etc", "etc/space", "lib", "lib/modules"] {
        c.entry(d, 0o040755, (0, 0), &[]);
    }
    c.entry("dev/console", 0o020600, (5, 1), &[]);
    let base = format!("lib/modules/{version}");
    let mut dirs = std::collections::BTreeSet::new();
    let mut list = String::new();
    for m in MODULES {
        let rel = format!("{base}/{m}");
        let mut p = Path::new(&rel).parent();
        let mut missing = vec![];
        while let Some(d) = p.filter(|d| *d != Path::new("lib/modules")) {
            if dirs.insert(d.to_path_buf()) {
                missing.push(d.to_path_buf());
            }
            p = d.parent();
        }
        for d in missing.iter().rev() {
            c.entry(d.to_str().unwrap(), 0o040755, (0, 0), &[]);
        }
        let src = Path::new(VM_DIR).join("modules").join(version).join(m);
        let data = std::fs::read(&src).with_context(|| format!("read {}", src.display()))?;
        c.entry(&rel, 0o100644, (0, 0), &data);
        list.push_str(&format!("/{rel}\n"));
    }
    c.entry("etc/space/modules", 0o100644, (0, 0), list.as_bytes());
    c.entry("init", 0o100755, (0, 0), &std::fs::read(daemon)?);
    c.entry("TRAILER!!!", 0, (0, 0), &[]);
    Ok(c.out)
}

fn rootfs_image(dir: &Path) -> Result<PathBuf> {
    let root = dir.join("rootfs");
    std::fs::create_dir_all(root.join("bin"))?;
    std::fs::create_dir_all(root.join("etc"))?;
    std::fs::create_dir_all(root.join("root"))?;
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).context("need busybox-static")?;
    for a in ["sh", "uname", "sleep", "echo", "cat", "hostname", "mount"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(a))?;
    }
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n")?;
    std::fs::write(root.join("etc/group"), "root:x:0:\n")?;
    let image = dir.join("rootfs.ext4");
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-d"])
        .arg(&root)
        .arg(&image)
        .arg("64M")
        .output()
        .context("mkfs.ext4")?;
    if !out.status.success() {
        bail!("mkfs.ext4: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(image)
}

struct Vm {
    child: Child,
    console: PathBuf,
}

impl Vm {
    fn console(&self) -> String {
        std::fs::read_to_string(&self.console).unwrap_or_default()
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn client(sock: &Path) -> Result<GuestClient<Channel>> {
    let path = sock.to_path_buf();
    let channel = Endpoint::from_static("http://guest")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await?;
    Ok(GuestClient::new(channel))
}

async fn exec_output(c: &mut GuestClient<Channel>, argv: &[&str]) -> Result<(String, i32)> {
    let mut s = c
        .exec(ExecRequest {
            argv: argv.iter().map(|a| a.to_string()).collect(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let (mut out, mut code) = (String::new(), -1);
    while let Some(ev) = s.next().await {
        match ev?.event {
            Some(Event::Output(o)) => out.push_str(&String::from_utf8_lossy(&o.data)),
            Some(Event::Exit(e)) => code = e.code,
            _ => {}
        }
    }
    Ok((out, code))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_boots_a_microvm_and_serves_across_reconnects() {
    if std::env::var("SPACE_REQUIRE_QEMU").as_deref() != Ok("1") {
        eprintln!("not booting QEMU: set SPACE_REQUIRE_QEMU=1 (see the file's header)");
        return;
    }
    if let Err(e) = run().await {
        panic!("{e:#}");
    }
}

async fn run() -> Result<()> {
    let daemon = static_daemon()?;
    let version = std::fs::read_to_string(format!("{VM_DIR}/version"))
        .context("guest kernel missing: run scripts/up")?
        .trim()
        .to_owned();
    let dir = tempfile::tempdir()?;
    let initrd = dir.path().join("initramfs.cpio");
    std::fs::File::create(&initrd)?.write_all(&initramfs(&daemon, &version)?)?;
    let image = rootfs_image(dir.path())?;
    let sock = dir.path().join("ch.sock");
    let console = dir.path().join("console.log");

    let started = Instant::now();
    let child = Command::new("qemu-system-x86_64")
        .args(["-M", "microvm,x-option-roms=off,pit=off,pic=off,rtc=on"])
        .args(["-accel", "tcg", "-m", "256", "-smp", "1"])
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
        ])
        .arg("-serial")
        .arg(format!("file:{}", console.display()))
        .args(["-append", CMDLINE])
        .arg("-kernel")
        .arg(format!("{VM_DIR}/vmlinuz"))
        .arg("-initrd")
        .arg(&initrd)
        .arg("-drive")
        .arg(format!(
            "id=root,format=raw,if=none,file={}",
            image.display()
        ))
        .args(["-device", "virtio-blk-device,drive=root"])
        .args(["-device", "virtio-serial-device"])
        .arg("-chardev")
        .arg(format!(
            "socket,id=ch0,path={},server=on,wait=off",
            sock.display()
        ))
        .args(["-device", "virtserialport,chardev=ch0,name=space.0"])
        .stdin(Stdio::null())
        .spawn()
        .context("qemu-system-x86_64")?;
    let mut vm = Vm { child, console };
    // A failure shows what the guest printed (the daemon logs to the console).
    if let Err(e) = exchange(&mut vm, &sock, &version, started).await {
        // The guest may still be logging what led to it.
        tokio::time::sleep(Duration::from_millis(500)).await;
        bail!("{e:#}\n--- console ---\n{}", vm.console());
    }
    eprintln!("--- console ---\n{}", vm.console());
    Ok(())
}

/// Everything the test asks of the booted guest.
async fn exchange(vm: &mut Vm, sock: &Path, version: &str, started: Instant) -> Result<()> {
    // First Info: connect (QEMU creates the socket at once) and retry until the guest answers.
    let deadline = started + Duration::from_secs(90);
    let (mut c, info) = loop {
        if let Some(st) = vm.child.try_wait()? {
            bail!("QEMU exited ({st}); console:\n{}", vm.console());
        }
        if Instant::now() > deadline {
            bail!("no Info within 90 s; console:\n{}", vm.console());
        }
        if let Ok(mut c) = client(sock).await
            && let Ok(Ok(r)) =
                tokio::time::timeout(Duration::from_secs(30), c.info(InfoRequest {})).await
        {
            break (c, r.into_inner());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let boot = started.elapsed();
    eprintln!(
        "boot to first Info (TCG): {:.0} ms",
        boot.as_secs_f64() * 1e3
    );
    assert_eq!(info.kernel_release, version);
    assert_eq!(info.pid, 1);
    assert!(!info.boot_id.is_empty());

    let (out, code) = exec_output(&mut c, &["uname", "-r"]).await?;
    assert_eq!((out.trim(), code), (version, 0));
    // The environment of a VM's processes and the root switch.
    let (out, _) = exec_output(
        &mut c,
        &["sh", "-c", "echo $HOME $TERM; cat /proc/self/mountinfo"],
    )
    .await?;
    assert!(out.starts_with("/root xterm-256color\n"), "{out}");
    assert!(
        out.contains(" / / rw") && out.contains(" - ext4 /dev/vda rw"),
        "{out}"
    );
    assert!(
        out.contains(" /tmp rw") && out.contains(" /dev/pts "),
        "{out}"
    );

    // A fresh identity: bad fields are refused whole, good ones applied.
    let bad = c
        .personalize(PersonalizeRequest {
            hostname: "not-applied".into(),
            machine_id: "NOT-HEX".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad:?}");
    // A multicast MAC, and one of the wrong length.
    for mac in [vec![0x01, 2, 3, 4, 5, 6], vec![0x02, 0, 0]] {
        let bad = c
            .personalize(PersonalizeRequest {
                mac,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad:?}");
    }
    let (before, _) = exec_output(&mut c, &["cat", "/proc/sys/kernel/random/boot_id"]).await?;
    // A clock one day ahead of the host's: the guest steps to whatever it is given.
    let day_ahead = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs()
        + 86_400;
    c.personalize(PersonalizeRequest {
        env: [
            ("PATH".to_string(), "/bin".to_string()),
            ("SPACE_DNS".to_string(), "169.254.0.1".to_string()),
        ]
        .into(),
        hostname: "vm-test".into(),
        entropy: vec![0x5a; 64],
        machine_id: "0123456789abcdef0123456789abcdef".into(),
        unix_time_ns: (day_ahead * 1_000_000_000) as i64,
        mac: Vec::new(),
    })
    .await?;
    assert_eq!(
        c.info(InfoRequest {}).await?.into_inner().hostname,
        "vm-test"
    );
    let (out, _) = exec_output(
        &mut c,
        &[
            "sh",
            "-c",
            "cat /etc/machine-id; date +%s; cat /proc/sys/kernel/random/boot_id; \
             grep nameserver /etc/resolv.conf; echo ${SPACE_DNS:-unset}",
        ],
    )
    .await?;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "0123456789abcdef0123456789abcdef", "{out}");
    let guest_now: u64 = lines[1].parse()?;
    assert!(
        guest_now >= day_ahead && guest_now < day_ahead + 120,
        "guest clock {guest_now}, stepped to {day_ahead}"
    );
    assert_eq!(lines[2], before.trim(), "the same boot");
    // The resolver from the daemon-only variable, which processes never see.
    assert_eq!(lines[3..], ["nameserver 169.254.0.1", "unset"], "{out}");

    // A background process, followed; the host goes away in the middle of the stream.
    let pid = c
        .start(ExecRequest {
            argv: vec![
                "sh".into(),
                "-c".into(),
                "echo first; exec sleep 300".into(),
            ],
            ..Default::default()
        })
        .await?
        .into_inner()
        .pid;
    let mut follow = c
        .attach(AttachRequest {
            pid,
            offset: 0,
            follow: true,
        })
        .await?
        .into_inner();
    let first = follow.next().await.context("no event")??;
    assert!(matches!(first.event, Some(Event::Output(_))), "{first:?}");
    drop(follow);
    drop(c);

    // Reconnect: same boot, same process table.
    for round in 1..=3 {
        let t = Instant::now();
        let mut c = loop {
            if let Ok(mut c) = client(sock).await
                && let Ok(Ok(r)) =
                    tokio::time::timeout(Duration::from_secs(10), c.info(InfoRequest {})).await
            {
                assert_eq!(r.into_inner().boot_id, info.boot_id);
                break c;
            }
            if t.elapsed() > Duration::from_secs(30) {
                bail!("reconnect {round} failed; console:\n{}", vm.console());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        eprintln!(
            "reconnect {round}: {:.0} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        let list = c
            .list_processes(ListProcessesRequest::default())
            .await?
            .into_inner();
        assert!(
            list.processes.iter().any(|p| p.pid == pid && p.running),
            "{list:?}"
        );
        let (out, code) = exec_output(&mut c, &["uname", "-r"]).await?;
        assert_eq!((out.trim(), code), (version, 0));
        if round == 2 {
            // Cut in the middle of a follow stream again, this time with the stream open.
            let mut f = c
                .attach(AttachRequest {
                    pid,
                    offset: 0,
                    follow: true,
                })
                .await?
                .into_inner();
            f.next().await.context("no event")??;
            drop(c);
            tokio::time::sleep(Duration::from_millis(200)).await;
            drop(f);
        }
    }
    Ok(())
}
