use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::process::Command;

use serde_json::json;

use super::initramfs::{S_IFCHR, S_IFDIR, S_IFREG, build, check_static, load_order};
use super::qemu::{Marker, parse_marker, parse_stat, port_opened};
use super::*;
use space_sys::process::parse_vmrss;

// ---- command line ------------------------------------------------------------------------

fn spec(accel: AccelKind) -> VmSpec {
    VmSpec {
        kernel: "/vm/vmlinuz".into(),
        initrd: "/work/initramfs.cpio".into(),
        accel,
        memory_mib: 512,
        vcpus: 2,
        disk: "/data/sb/disk,1.ext4".into(),
        channel_socket: "/run/space/sandboxes/a1/guest.sock".into(),
        console: "/run/space/sandboxes/a1/console.log".into(),
        console_socket: "/run/space/sandboxes/a1/console.sock".into(),
        qmp: "/run/space/sandboxes/a1/qmp.sock".into(),
        mac: [0x02, 0, 0, 0, 0, 1],
    }
}

pub(super) fn strings(a: Vec<std::ffi::OsString>) -> Vec<String> {
    a.into_iter().map(|s| s.into_string().unwrap()).collect()
}

/// Every value following `flag`.
fn all_after<'a>(args: &'a [String], flag: &str) -> Vec<&'a str> {
    args.windows(2)
        .filter(|w| w[0] == flag)
        .map(|w| w[1].as_str())
        .collect()
}

fn after<'a>(args: &'a [String], flag: &str) -> &'a str {
    let v = all_after(args, flag);
    assert_eq!(v.len(), 1, "{flag} given {} times in {args:?}", v.len());
    v[0]
}

#[test]
fn tcg_command_line_follows_the_contract() {
    let args = strings(spec(AccelKind::Tcg).args());
    assert_eq!(
        after(&args, "-M"),
        "microvm,x-option-roms=off,pit=off,pic=off,rtc=on"
    );
    assert_eq!(after(&args, "-accel"), "tcg,tb-size=64");
    assert_eq!(after(&args, "-cpu"), "max");
    assert_eq!(after(&args, "-m"), "512");
    assert_eq!(after(&args, "-smp"), "2");
    assert_eq!(after(&args, "-kernel"), "/vm/vmlinuz");
    assert_eq!(after(&args, "-initrd"), "/work/initramfs.cpio");
    assert_eq!(
        after(&args, "-append"),
        "console=ttyS0 panic=-1 quiet rdinit=/init SPACE_GUEST=vm tsc_early_khz=2000000"
    );
    // The comma in the disk path is doubled, QEMU's escape.
    assert_eq!(
        after(&args, "-drive"),
        "id=root,format=raw,if=none,cache=writeback,discard=unmap,file=/data/sb/disk,,1.ext4"
    );
    assert_eq!(
        all_after(&args, "-device"),
        [
            "virtio-blk-device,drive=root",
            "virtio-serial-device,max_ports=2",
            "virtserialport,chardev=ch0,id=space0,name=space.0",
        ]
    );
    assert_eq!(
        all_after(&args, "-chardev"),
        [
            "socket,id=ch0,server=on,wait=off,path=/run/space/sandboxes/a1/guest.sock",
            "socket,id=con,path=/run/space/sandboxes/a1/console.sock",
            "socket,id=qmp,server=on,wait=off,path=/run/space/sandboxes/a1/qmp.sock",
        ]
    );
    assert_eq!(after(&args, "-serial"), "chardev:con");
    assert_eq!(after(&args, "-mon"), "chardev=qmp,mode=control");
    assert_eq!(
        after(&args, "-sandbox"),
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
    );
    for flag in ["-nodefaults", "-no-user-config", "-no-reboot"] {
        assert!(args.iter().any(|a| a == flag), "{flag} missing");
    }
    assert_eq!(after(&args, "-display"), "none");
}

#[test]
fn kvm_command_line_uses_the_host_cpu_and_no_tsc_hint() {
    let tcg = strings(spec(AccelKind::Tcg).args());
    let kvm = strings(spec(AccelKind::Kvm).args());
    assert_eq!(after(&kvm, "-accel"), "kvm");
    assert_eq!(after(&kvm, "-cpu"), "host");
    assert_eq!(after(&kvm, "-append"), qemu::KERNEL_CMDLINE);
    assert!(!after(&kvm, "-append").contains("tsc_early_khz"));
    // Nothing else differs.
    let differ: Vec<_> = tcg
        .iter()
        .zip(&kvm)
        .filter(|(a, b)| a != b)
        .map(|(a, _)| a.as_str())
        .collect();
    assert_eq!(tcg.len(), kvm.len());
    assert_eq!(
        differ,
        [
            "tcg,tb-size=64",
            "max",
            "console=ttyS0 panic=-1 quiet rdinit=/init SPACE_GUEST=vm tsc_early_khz=2000000"
        ]
    );
}

#[test]
fn the_documented_contract_matches_the_constants() {
    let doc = include_str!("mod.rs");
    assert!(doc.contains(&format!("`{}`", qemu::KERNEL_CMDLINE)));
    assert!(doc.contains(&format!("`{}`", qemu::TCG_CMDLINE)));
    assert!(doc.contains(&format!("`{READY_MARKER}`")));
    assert!(doc.contains(&format!("`{}<why>`", FAILED_MARKER)));
    assert!(doc.contains(&format!("named `{CHANNEL_PORT}`")));
    assert!(doc.contains(&format!("`/{MODULES_LIST}`")));
}

#[test]
fn sizes_follow_the_limits() {
    let l = |cpu_millis, memory_mib| Limits {
        cpu_millis,
        memory_mib,
        pids: 100,
        rlimits: Default::default(),
        disk_mib: None,
    };
    assert_eq!(vcpus_for(&l(1, 512), 8), 1);
    assert_eq!(vcpus_for(&l(1000, 512), 8), 1);
    assert_eq!(vcpus_for(&l(1001, 512), 8), 2);
    assert_eq!(vcpus_for(&l(2500, 512), 8), 3);
    assert_eq!(vcpus_for(&l(0, 512), 8), 1);
    assert_eq!(vcpus_for(&l(16000, 512), 4), 4, "capped at the host's CPUs");
    assert_eq!(memory_mib_for(&l(1000, 64)), MIN_MEMORY_MIB);
    assert_eq!(memory_mib_for(&l(1000, 128)), 128);
    assert_eq!(memory_mib_for(&l(1000, 2048)), 2048);
}

#[test]
fn accel_parses_and_prints() {
    for a in [Accel::Auto, Accel::Kvm, Accel::Tcg] {
        assert_eq!(a.to_string().parse::<Accel>().unwrap(), a);
    }
    let e = "hvf".parse::<Accel>().unwrap_err();
    assert!(e.contains("auto, kvm or tcg"), "{e}");
}

// ---- modules and initramfs -------------------------------------------------------------------

const DEP: &str = "kernel/drivers/virtio/virtio_ring.ko:\n\
    kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko\n\
    kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n\
    kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n\
    kernel/drivers/char/virtio_console.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n\
    kernel/net/core/failover.ko:\n\
    kernel/drivers/net/virtio_net.ko: kernel/net/core/failover.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n";

const ORDER: [&str; 7] = [
    "kernel/drivers/virtio/virtio_ring.ko",
    "kernel/drivers/virtio/virtio.ko",
    "kernel/drivers/virtio/virtio_mmio.ko",
    "kernel/drivers/block/virtio_blk.ko",
    "kernel/drivers/char/virtio_console.ko",
    "kernel/net/core/failover.ko",
    "kernel/drivers/net/virtio_net.ko",
];

#[test]
fn module_order_puts_dependencies_first_once_and_skips_builtins() {
    let builtin = "kernel/fs/ext4/ext4.ko\nkernel/fs/jbd2/jbd2.ko\n";
    assert_eq!(load_order(DEP, builtin, WANTED_MODULES).unwrap(), ORDER);
    // Dashes and underscores name the same module; virtio_net pulls in failover first.
    let net = load_order(DEP, builtin, &["virtio-net"]).unwrap();
    assert_eq!(
        net,
        [
            "kernel/drivers/virtio/virtio_ring.ko",
            "kernel/drivers/virtio/virtio.ko",
            "kernel/net/core/failover.ko",
            "kernel/drivers/net/virtio_net.ko",
        ]
    );
}

#[test]
fn module_order_names_what_is_missing() {
    let e = load_order(DEP, "", WANTED_MODULES).unwrap_err().to_string();
    assert!(e.contains("ext4") && e.contains("scripts/up"), "{e}");
    let e = load_order("garbage", "", &["x"]).unwrap_err().to_string();
    assert!(e.contains("without ':'"), "{e}");
}

/// A fake guest kernel directory as `ensure_guest_kernel` lays it out.
fn fake_vm_dir(dir: &Path) {
    fs::write(dir.join("vmlinuz"), b"not a kernel").unwrap();
    fs::write(dir.join("version"), "6.1.0-test\n").unwrap();
    let m = dir.join("modules/6.1.0-test");
    for p in ORDER {
        fs::create_dir_all(m.join(p).parent().unwrap()).unwrap();
        fs::write(m.join(p), format!("module {p}")).unwrap();
    }
    fs::write(m.join("modules.dep"), DEP).unwrap();
    fs::write(m.join("modules.builtin"), "kernel/fs/ext4/ext4.ko\n").unwrap();
}

/// (name, mode, (rdevmajor, rdevminor), data)
type Entry = (String, u32, (u32, u32), Vec<u8>);

/// Parses a newc archive back, checking magic, NUL-terminated names and 4-byte alignment.
fn parse_newc(mut b: &[u8]) -> Vec<Entry> {
    assert_eq!(b.len() % 4, 0);
    let mut out = Vec::new();
    loop {
        assert_eq!(&b[..6], b"070701");
        let hex = |i: usize| {
            u32::from_str_radix(std::str::from_utf8(&b[6 + i * 8..14 + i * 8]).unwrap(), 16)
                .unwrap()
        };
        let (mode, size, rmaj, rmin, namesize) =
            (hex(1), hex(6) as usize, hex(9), hex(10), hex(11) as usize);
        let name = std::str::from_utf8(&b[110..110 + namesize - 1])
            .unwrap()
            .to_owned();
        assert_eq!(b[110 + namesize - 1], 0);
        let data_at = (110 + namesize).div_ceil(4) * 4;
        let data = b[data_at..data_at + size].to_vec();
        b = &b[((data_at + size).div_ceil(4) * 4).min(b.len())..];
        if name == "TRAILER!!!" {
            assert!(b.is_empty());
            return out;
        }
        out.push((name, mode, (rmaj, rmin), data));
    }
}

#[test]
fn initramfs_holds_init_console_modules_and_their_list() {
    let d = tempfile::tempdir().unwrap();
    fake_vm_dir(d.path());
    let kernel = GuestKernel::locate(d.path()).unwrap();
    assert_eq!(kernel.version, "6.1.0-test");
    let order = kernel.load_order(WANTED_MODULES).unwrap();
    assert_eq!(order, ORDER);
    let extra = [ExtraFile {
        path: "/bin/x".into(),
        mode: 0o700,
        data: b"x".to_vec(),
    }];
    let bytes = build(&kernel, &order, b"\x7fELF daemon", &extra).unwrap();
    let entries = parse_newc(&bytes);
    let get = |n: &str| {
        entries
            .iter()
            .find(|e| e.0 == n)
            .unwrap_or_else(|| panic!("{n} missing from {:?}", names(&entries)))
    };
    fn names(e: &[Entry]) -> Vec<&str> {
        e.iter().map(|e| e.0.as_str()).collect()
    }
    let init = get("init");
    assert_eq!(
        (init.1, init.3.as_slice()),
        (S_IFREG | 0o755, &b"\x7fELF daemon"[..])
    );
    let console = get("dev/console");
    assert_eq!((console.1, console.2), (S_IFCHR | 0o600, (5, 1)));
    let list = String::from_utf8(get(MODULES_LIST).3.clone()).unwrap();
    let want: Vec<String> = ORDER
        .iter()
        .map(|p| format!("/lib/modules/6.1.0-test/{p}"))
        .collect();
    assert_eq!(list.lines().collect::<Vec<_>>(), want);
    for (p, path) in ORDER.iter().zip(&want) {
        let m = get(path.trim_start_matches('/'));
        assert_eq!(m.1, S_IFREG | 0o644);
        assert_eq!(m.3, format!("module {p}").into_bytes());
    }
    assert_eq!(get("bin/x").1, S_IFREG | 0o700);
    // Every parent directory comes before what it holds, once.
    let all = names(&entries);
    for (i, e) in entries.iter().enumerate() {
        let mut p = Path::new(&e.0).parent();
        while let Some(dir) = p.filter(|d| !d.as_os_str().is_empty()) {
            let at = all
                .iter()
                .position(|n| Path::new(n) == dir)
                .unwrap_or_else(|| panic!("no directory entry for {}", dir.display()));
            assert!(at < i && entries[at].1 == S_IFDIR | 0o755, "{}", e.0);
            p = dir.parent();
        }
    }
    let mut dedup = all.clone();
    dedup.sort();
    dedup.dedup();
    assert_eq!(dedup.len(), all.len(), "duplicate entries: {all:?}");
}

/// A minimal 64-bit ELF header with one program header of type `ptype`.
fn elf_with(ptype: u32) -> Vec<u8> {
    let mut b = vec![0u8; 64 + 56];
    b[..4].copy_from_slice(b"\x7fELF");
    b[4] = 2;
    b[5] = 1;
    b[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
    b[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
    b[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
    b[64..68].copy_from_slice(&ptype.to_le_bytes());
    b
}

#[test]
fn only_static_executables_become_init() {
    let p = Path::new("/x/space-daemon");
    check_static(p, &elf_with(1)).unwrap();
    let e = check_static(p, &elf_with(3)).unwrap_err().to_string();
    assert!(
        e.contains("/x/space-daemon")
            && e.contains("dynamically linked")
            && e.contains("crt-static"),
        "{e}"
    );
    let e = check_static(p, b"#!/bin/sh\n").unwrap_err().to_string();
    assert!(e.contains("not an ELF"), "{e}");
    let mut truncated = elf_with(1);
    truncated.truncate(80);
    assert!(check_static(p, &truncated).is_err());
}

// ---- setup errors ----------------------------------------------------------------------------

fn config(dir: &Path) -> MicrovmConfig {
    MicrovmConfig {
        work_dir: dir.join("work"),
        accel: Accel::Tcg,
        ..MicrovmConfig::default()
    }
}

#[test]
fn missing_pieces_are_named_with_their_fix() {
    let d = tempfile::tempdir().unwrap();
    fake_vm_dir(&d.path().join("vm").tap_mkdir());
    let daemon = d.path().join("space-daemon");
    fs::write(&daemon, elf_with(1)).unwrap();
    let base = MicrovmConfig {
        vm_dir: d.path().join("vm"),
        daemon_binary: daemon.clone(),
        // Any file passes the QEMU lookup; nothing is run with Accel::Tcg.
        qemu: "/bin/sh".into(),
        ..config(d.path())
    };

    let e = MicrovmRuntime::new(MicrovmConfig {
        qemu: "/nonexistent/qemu-system-x86_64".into(),
        ..base.clone()
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("apt-get install qemu-system-x86"), "{e}");
    let e = MicrovmRuntime::new(MicrovmConfig {
        qemu: "qemu-system-space-none".into(),
        ..base.clone()
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("not in PATH") && e.contains("apt-get install qemu-system-x86"),
        "{e}"
    );

    let empty = d.path().join("empty").tap_mkdir();
    let e = MicrovmRuntime::new(MicrovmConfig {
        vm_dir: empty,
        ..base.clone()
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("run scripts/up")
            && e.contains("linux-image-cloud-amd64")
            && e.contains("vmlinuz"),
        "{e}"
    );

    let e = MicrovmRuntime::new(MicrovmConfig {
        daemon_binary: d.path().join("nope"),
        ..base.clone()
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(&d.path().join("nope").display().to_string()),
        "{e}"
    );

    fs::write(&daemon, elf_with(3)).unwrap();
    let e = MicrovmRuntime::new(base.clone()).unwrap_err().to_string();
    assert!(e.contains("dynamically linked"), "{e}");

    // With everything present the runtime comes up and writes its initramfs.
    fs::write(&daemon, elf_with(1)).unwrap();
    let rt = MicrovmRuntime::new(base).unwrap();
    assert_eq!(rt.accel(), "tcg");
    assert!(rt.accel_note().contains("forced"), "{}", rt.accel_note());
    assert_eq!(rt.kind(), crate::api::RuntimeKind::Microvm);
    let entries = parse_newc(&fs::read(rt.initramfs()).unwrap());
    assert!(entries.iter().any(|e| e.0 == "init" && e.3 == elf_with(1)));
}

#[tokio::test]
async fn launch_needs_a_disk() {
    let d = tempfile::tempdir().unwrap();
    fake_vm_dir(&d.path().join("vm").tap_mkdir());
    let rt = MicrovmRuntime::with_init(
        MicrovmConfig {
            vm_dir: d.path().join("vm"),
            qemu: "/bin/sh".into(),
            ..config(d.path())
        },
        b"init",
        &[],
    )
    .unwrap();
    let mut plan = plan(d.path(), "vm1", None);
    let e = rt.launch(&plan).await.unwrap_err().to_string();
    assert!(e.contains("needs LaunchPlan::disk"), "{e}");
    plan.disk = Some(d.path().join("missing.ext4"));
    let e = rt.launch(&plan).await.unwrap_err().to_string();
    assert!(e.contains("missing.ext4 does not exist"), "{e}");
    // Nothing known about it: destroy is a no-op, pause says why.
    rt.destroy("vm1", None).await.unwrap();
    assert!(!rt.is_frozen("vm1"));
    let e = rt.set_frozen("vm1", true).await.unwrap_err().to_string();
    assert!(e.contains("no QMP socket known for VM vm1"), "{e}");
}

trait TapMkdir {
    fn tap_mkdir(self) -> PathBuf;
}

impl TapMkdir for PathBuf {
    fn tap_mkdir(self) -> PathBuf {
        fs::create_dir_all(&self).unwrap();
        self
    }
}

fn plan(dir: &Path, id: &str, disk: Option<PathBuf>) -> LaunchPlan {
    let run_dir = dir.join("run").join(id);
    LaunchPlan {
        id: id.to_owned(),
        rootfs: dir.join("unused-rootfs"),
        uid_base: 1_000_000_000,
        id_count: 65536,
        hostname: id.to_owned(),
        limits: Limits {
            cpu_millis: 1000,
            memory_mib: 256,
            pids: 256,
            rlimits: Default::default(),
            disk_mib: None,
        },
        env: Vec::new(),
        daemon_binary: dir.join("unused-daemon"),
        channel_socket: run_dir.join("guest.sock"),
        run_dir,
        netns: None,
        disk,
    }
}

// ---- disks -----------------------------------------------------------------------------------

fn debugfs(image: &Path, request: &str) -> String {
    let out = Command::new("debugfs")
        .args(["-R", request])
        .arg(image)
        .output()
        .expect("debugfs (e2fsprogs) runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn small_rootfs(root: &Path) {
    fs::create_dir_all(root.join("etc")).unwrap();
    fs::write(root.join("etc/hostname"), "space\n").unwrap();
    fs::write(root.join("big"), vec![7u8; 3 << 20]).unwrap();
    std::os::unix::fs::symlink("etc/hostname", root.join("link")).unwrap();
    std::os::unix::fs::chown(root.join("etc/hostname"), Some(1000), Some(1001)).unwrap();
}

#[test]
fn template_disk_is_a_sparse_ext4_image_of_the_rootfs() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("rootfs");
    small_rootfs(&root);
    let image = d.path().join("disk.ext4");
    ensure_template_disk(&root, &image).unwrap();

    let md = fs::metadata(&image).unwrap();
    let usage = disk::tree_usage(&root).unwrap();
    assert!(usage.bytes >= 3 << 20 && usage.inodes == 5, "{usage:?}");
    assert_eq!(md.len(), disk::image_size(usage));
    assert_eq!(md.len() % (1 << 20), 0);
    assert!(md.len() >= (3 << 20) * 3 / 2 + HEADROOM_BYTES);
    assert!(
        md.blocks() * 512 < md.len() / 4,
        "not sparse: {} of {} bytes allocated",
        md.blocks() * 512,
        md.len()
    );
    // ext4 magic and label in the superblock.
    let bytes = fs::read(&image).unwrap();
    assert_eq!(&bytes[1024 + 0x38..1024 + 0x3a], &[0x53, 0xef]);
    assert_eq!(&bytes[1024 + 0x78..1024 + 0x78 + 10], b"space-root");
    drop(bytes);
    assert_eq!(debugfs(&image, "cat /etc/hostname"), "space\n");
    let stat = debugfs(&image, "stat /etc/hostname");
    assert!(
        stat.contains("User:  1000") && stat.contains("Group:  1001"),
        "{stat}"
    );
    assert!(debugfs(&image, "stat /link").contains("Type: symlink"));

    // Idempotent: an existing image is kept as it is.
    let before = fs::metadata(&image).unwrap().modified().unwrap();
    fs::write(root.join("new"), "x").unwrap();
    ensure_template_disk(&root, &image).unwrap();
    assert_eq!(fs::metadata(&image).unwrap().modified().unwrap(), before);
    // No temporary files left behind.
    let left: Vec<_> = fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");

    let e = ensure_template_disk(&d.path().join("nope"), &d.path().join("x.ext4"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("is not a directory"), "{e}");
}

/// A small btrfs filesystem on a loop device, unmounted on drop.
struct BtrfsLoop {
    mnt: PathBuf,
    _dir: tempfile::TempDir,
}

impl BtrfsLoop {
    fn new() -> Option<Self> {
        let mkfs = [
            "/usr/sbin/mkfs.btrfs",
            "/sbin/mkfs.btrfs",
            "/usr/bin/mkfs.btrfs",
        ]
        .into_iter()
        .find(|p| Path::new(p).is_file())?;
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("btrfs.img");
        fs::File::create(&img).unwrap().set_len(128 << 20).unwrap();
        let ok = Command::new(mkfs).arg("-q").arg(&img).status().unwrap();
        assert!(ok.success(), "mkfs.btrfs failed");
        let mnt = dir.path().join("mnt").tap_mkdir();
        let ok = Command::new("mount")
            .args(["-o", "loop"])
            .arg(&img)
            .arg(&mnt)
            .status()
            .unwrap();
        assert!(
            ok.success(),
            "mounting a btrfs loop image failed (root needed)"
        );
        Some(Self { mnt, _dir: dir })
    }
}

impl Drop for BtrfsLoop {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mnt).status();
    }
}

#[test]
fn clone_disk_reflinks_on_btrfs_and_refuses_elsewhere() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("rootfs");
    small_rootfs(&root);
    let Some(btrfs) = BtrfsLoop::new() else {
        eprintln!("skipping the reflink half: mkfs.btrfs missing (apt-get install btrfs-progs)");
        return;
    };
    let template = btrfs.mnt.join("template.ext4");
    ensure_template_disk(&root, &template).unwrap();
    let sandbox = btrfs.mnt.join("sandbox.ext4");
    let t0 = Instant::now();
    clone_disk(&template, &sandbox).unwrap();
    let took = t0.elapsed();
    assert_eq!(fs::read(&template).unwrap(), fs::read(&sandbox).unwrap());
    assert!(took < Duration::from_secs(1), "{took:?}");
    // Shared extents: the clone took (almost) no new space.
    let out = Command::new("btrfs")
        .args(["filesystem", "du", "--raw"])
        .arg(&sandbox)
        .output();
    if let Some(out) = out.ok().filter(|o| o.status.success()) {
        let text = String::from_utf8_lossy(&out.stdout);
        let exclusive: u64 = text
            .lines()
            .nth(1)
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|n| n.parse().ok())
            .unwrap();
        assert_eq!(exclusive, 0, "{text}");
    }
    let e = clone_disk(&template, &sandbox).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::AlreadyExists, "{e}");

    // The tempdir's filesystem (ext4 or tmpfs here) cannot reflink, and across filesystems
    // nothing can: a clear error and no file left.
    let elsewhere = d.path().join("copy.ext4");
    let e = clone_disk(&template, &elsewhere).unwrap_err().to_string();
    assert!(e.contains("cannot clone") && e.contains("copy.ext4"), "{e}");
    assert!(!elsewhere.exists());
    let local = d.path().join("local.ext4");
    ensure_template_disk(&root, &local).unwrap();
    let e = clone_disk(&local, &d.path().join("local2.ext4"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot reflink") || e.contains("FICLONE"), "{e}");
    assert!(!d.path().join("local2.ext4").exists());
}

// ---- QMP, console, /proc --------------------------------------------------------------------

#[test]
fn qmp_client_matches_ids_keeps_events_and_reports_errors() {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let fake = std::thread::spawn(move || {
        let mut r = BufReader::new(theirs.try_clone().unwrap());
        let mut w = theirs;
        w.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
            .unwrap();
        let mut seen = Vec::new();
        let mut line = String::new();
        for reply in [
            "{\"return\": {}, \"id\": 1}\n",
            // An event split across writes, a stale answer, then ours.
            "{\"event\": \"STOP\", \"timest",
            "{\"error\": {\"class\": \"GenericError\", \"desc\": \"no such thing\"}, \"id\": 3}\n",
        ] {
            line.clear();
            r.read_line(&mut line).unwrap();
            seen.push(serde_json::from_str::<serde_json::Value>(&line).unwrap());
            w.write_all(reply.as_bytes()).unwrap();
            if reply.ends_with("timest") {
                std::thread::sleep(Duration::from_millis(50));
                w.write_all(
                    b"amp\": {}}\n{\"return\": {\"status\": \"old\"}, \"id\": 99}\n\
                      {\"return\": {\"status\": \"paused\"}, \"id\": 2}\n",
                )
                .unwrap();
            }
        }
        seen
    });
    let deadline = || Instant::now() + Duration::from_secs(10);
    let mut q = Qmp::handshake(ours, deadline()).unwrap();
    assert_eq!(q.status(deadline()).unwrap(), "paused");
    assert_eq!(q.events.len(), 1);
    assert_eq!(q.events[0]["event"], "STOP");
    let e = q
        .execute("stop", Some(json!({"x": 1})), deadline())
        .unwrap_err()
        .to_string();
    assert_eq!(e, "QMP stop failed: no such thing (GenericError)");
    let seen = fake.join().unwrap();
    assert_eq!(seen[0], json!({"execute": "qmp_capabilities", "id": 1}));
    assert_eq!(seen[1], json!({"execute": "query-status", "id": 2}));
    assert_eq!(
        seen[2],
        json!({"execute": "stop", "id": 3, "arguments": {"x": 1}})
    );
    // The peer is gone: a clear error, not a hang.
    let e = q.status(deadline()).unwrap_err().to_string();
    assert!(e.contains("closed") || e.contains("i/o"), "{e}");
}

#[test]
fn qmp_keeps_an_event_that_comes_before_the_greeting() {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let fake = std::thread::spawn(move || {
        let mut r = BufReader::new(theirs.try_clone().unwrap());
        let mut w = theirs;
        w.write_all(
            b"{\"event\": \"RESUME\", \"timestamp\": {}}\n\
              {\"QMP\": {\"version\": {}, \"capabilities\": []}}\n",
        )
        .unwrap();
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        w.write_all(b"{\"return\": {}, \"id\": 1}\n").unwrap();
        // Then only events: no greeting comes, and the handshake gives up with a clear error.
        let (ours, theirs) = UnixStream::pair().unwrap();
        let mut w = theirs;
        for _ in 0..20 {
            w.write_all(b"{\"event\": \"STOP\", \"timestamp\": {}}\n")
                .unwrap();
        }
        (ours, w)
    });
    let deadline = || Instant::now() + Duration::from_secs(10);
    let q = Qmp::handshake(ours, deadline()).unwrap();
    assert_eq!(q.events.len(), 1);
    assert_eq!(q.events[0]["event"], "RESUME");
    let (ours, _w) = fake.join().unwrap();
    let e = Qmp::handshake(ours, deadline()).unwrap_err().to_string();
    assert!(e.contains("greeting expected"), "{e}");
}

#[test]
fn qmp_read_gives_up_at_its_deadline() {
    let (ours, _theirs) = UnixStream::pair().unwrap();
    let t0 = Instant::now();
    let e = Qmp::handshake(ours, Instant::now() + Duration::from_millis(100))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no QMP answer to the greeting"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(2));
}

#[test]
fn console_markers_and_port_events_parse() {
    assert_eq!(
        parse_marker("space-daemon: serving\r\n"),
        Some(Marker::Ready)
    );
    assert_eq!(
        parse_marker("space-daemon: failed no /dev/vda after 10 s\n"),
        Some(Marker::Failed("no /dev/vda after 10 s".into()))
    );
    assert_eq!(parse_marker("[ 1.0] space-daemon: serving"), None);
    assert_eq!(parse_marker("space-daemon: serving later"), None);
    assert!(port_opened(
        &json!({"event": "VSERPORT_CHANGE", "data": {"id": "space0", "open": true}})
    ));
    assert!(!port_opened(
        &json!({"event": "VSERPORT_CHANGE", "data": {"id": "space0", "open": false}})
    ));
    assert!(!port_opened(
        &json!({"event": "VSERPORT_CHANGE", "data": {"id": "other", "open": true}})
    ));

    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("console.log");
    let mut con = qemu::ConsoleTail::new(&p);
    assert_eq!(con.poll(), None, "no file yet");
    fs::write(&p, "boot\nspace-daemon: ser").unwrap();
    assert_eq!(con.poll(), None, "half a line is not a marker");
    let mut f = fs::OpenOptions::new().append(true).open(&p).unwrap();
    f.write_all(b"ving\r\nmore\n").unwrap();
    assert_eq!(con.poll(), Some(Marker::Ready));
    assert_eq!(con.last, ["boot", "space-daemon: serving", "more"]);
    for i in 0..30 {
        writeln!(f, "[    2.{i:06}]  trace line {i}").unwrap();
    }
    writeln!(
        f,
        "[    2.4] Kernel panic - not syncing: Attempted to kill init!"
    )
    .unwrap();
    writeln!(f, "[    2.5] trace after").unwrap();
    assert_eq!(con.poll(), None);
    let d = con.describe();
    assert!(
        d.contains("more") && d.contains("Kernel panic") && d.contains("trace after"),
        "{d}"
    );
    assert!(!d.contains("trace line 3\""), "{d}");
}

#[test]
fn proc_parsing() {
    let stat = "4242 (qemu-system-x86) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 6 0 0 20 0 3 0 987654 1000 200";
    assert_eq!(
        parse_stat(stat),
        Some(qemu::ProcStat {
            state: 'S',
            start_time: 987654
        })
    );
    assert_eq!(parse_stat("1 (a) b) R 1 2"), None);
    assert_eq!(
        parse_vmrss("Name:\tqemu\nVmRSS:\t  204800 kB\nVmSwap: 0 kB\n"),
        Some(200 << 20)
    );
    assert_eq!(parse_vmrss("Name: x\n"), None);
    let me = qemu::read_stat(std::process::id()).unwrap();
    assert!(is_alive(&Launched {
        init_pid: std::process::id(),
        start_time: me.start_time
    }));
    assert!(!is_alive(&Launched {
        init_pid: std::process::id(),
        start_time: me.start_time + 1
    }));
}

// ---- real VMs --------------------------------------------------------------------------------

/// Why real VMs cannot run here, or None. With SPACE_REQUIRE_QEMU=1 that is a failure; else
/// the caller says why it does nothing.
fn qemu_missing() -> Option<String> {
    let required = std::env::var("SPACE_REQUIRE_QEMU").as_deref() == Ok("1");
    let why = if find_qemu(Path::new(DEFAULT_QEMU)).is_err() {
        Some(format!(
            "{DEFAULT_QEMU} not installed: apt-get install qemu-system-x86"
        ))
    } else if let Err(e) = GuestKernel::locate(Path::new(DEFAULT_VM_DIR)) {
        Some(e.to_string())
    } else if !Path::new("/bin/busybox").is_file() {
        Some("/bin/busybox missing: apt-get install busybox-static".to_owned())
    } else {
        None
    };
    match why {
        Some(w) if required => panic!("SPACE_REQUIRE_QEMU=1 but {w}"),
        Some(w) => Some(w),
        None if !required => {
            Some("SPACE_REQUIRE_QEMU is not 1 (real VMs take seconds under TCG)".into())
        }
        None => None,
    }
}

/// A busybox init standing in for the daemon: loads the modules from the list, mounts the
/// disk, prints its hello file, reports ready, then echoes the channel port.
const SHELL_INIT: &str = r#"#!/bin/busybox sh
b=/bin/busybox
fail() { echo "space-daemon: failed $*" >/dev/console; $b poweroff -f; }
$b mkdir -p /proc /sys /newroot
$b mount -t devtmpfs dev /dev || fail devtmpfs
$b mount -t sysfs sys /sys || fail sysfs
for m in $($b cat /etc/space/modules); do $b insmod "$m" || fail "insmod $m"; done
i=0
while [ ! -b /dev/vda ]; do i=$((i+1)); [ $i -gt 1000 ] && fail "no /dev/vda"; $b usleep 10000; done
$b mount -t ext4 /dev/vda /newroot || fail "mount /dev/vda"
echo "hello file: $($b cat /newroot/etc/hostname)" >/dev/console
port=
i=0
while [ -z "$port" ]; do
  for d in /sys/class/virtio-ports/*; do
    [ "$($b cat "$d/name" 2>/dev/null)" = space.0 ] && port=/dev/${d##*/}
  done
  [ -z "$port" ] && { i=$((i+1)); [ $i -gt 1000 ] && fail "no space.0 port"; $b usleep 10000; }
done
[ -c "$port" ] || fail "$port is no device"
echo "space-daemon: serving" >/dev/console
exec 3<>"$port"
# A read with no host on the channel returns 0 (virtio_console), which ends cat: the host may
# connect only after this line, so cat starts again until it has one.
while :; do $b cat <&3 >&3; $b usleep 20000; done
"#;

fn shell_runtime(work: &Path, init: &str, boot_timeout: Duration) -> MicrovmRuntime {
    shell_runtime_jailed(work, init, boot_timeout, true)
}

fn shell_runtime_jailed(
    work: &Path,
    init: &str,
    boot_timeout: Duration,
    jail: bool,
) -> MicrovmRuntime {
    let cfg = MicrovmConfig {
        jail,
        cgroup_parent: "space-vm-test".to_owned(),
        work_dir: work.to_path_buf(),
        accel: Accel::Auto,
        boot_timeout,
        destroy_timeout: Duration::from_secs(2),
        run_root: Some(work.join("run")),
        ..MicrovmConfig::default()
    };
    let busybox = ExtraFile {
        path: "bin/busybox".into(),
        mode: 0o755,
        data: fs::read("/bin/busybox").unwrap(),
    };
    MicrovmRuntime::with_init(cfg, init.as_bytes(), &[busybox]).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vm_boots_serves_its_channel_pauses_and_dies() {
    if let Some(why) = qemu_missing() {
        eprintln!("skipping the real microvm launch: {why}");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("rootfs");
    small_rootfs(&root);
    let disk = d.path().join("disk.ext4");
    ensure_template_disk(&root, &disk).unwrap();
    let rt = shell_runtime(d.path(), SHELL_INIT, Duration::from_secs(60));
    eprintln!("accelerator: {}", rt.accel_note());
    let plan = plan(d.path(), "vm1", Some(disk));

    let t0 = Instant::now();
    let launched = rt.launch(&plan).await.unwrap();
    let took = t0.elapsed();
    let times = rt.boot_times("vm1").unwrap();
    eprintln!(
        "launch: {took:?} (QMP ready {:?}, guest ready {:?} by {})",
        times.qmp_ready, times.guest_ready, times.ready_by
    );
    assert!(rt.alive(&launched));
    let console = fs::read_to_string(plan.run_dir.join("console.log")).unwrap();
    assert!(console.contains("hello file: space"), "{console}");

    // The channel: bytes written on the host come back from the guest's echo.
    let mut ch = UnixStream::connect(&plan.channel_socket).unwrap();
    ch.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    ch.write_all(b"ping over virtio-serial\n").unwrap();
    let mut got = vec![0u8; 24];
    ch.read_exact(&mut got).unwrap();
    assert_eq!(got, b"ping over virtio-serial\n");

    let rss = rt.memory_bytes("vm1").unwrap();
    assert!(rss > 10 << 20, "QEMU RSS {rss}");

    assert!(!rt.is_frozen("vm1"));
    rt.set_frozen("vm1", true).await.unwrap();
    assert!(rt.is_frozen("vm1"));
    rt.set_frozen("vm1", false).await.unwrap();
    assert!(!rt.is_frozen("vm1"));

    // Paused VMs are destroyed too.
    rt.set_frozen("vm1", true).await.unwrap();
    let t0 = Instant::now();
    rt.destroy("vm1", Some(&launched)).await.unwrap();
    eprintln!("destroy: {:?}", t0.elapsed());
    assert!(!rt.alive(&launched));
    assert!(!plan.channel_socket.exists() && !plan.run_dir.join("qmp.sock").exists());
    rt.destroy("vm1", Some(&launched)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vm_failures_are_reported_and_cleaned_up() {
    if let Some(why) = qemu_missing() {
        eprintln!("skipping the real microvm failures: {why}");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("rootfs");
    small_rootfs(&root);
    let disk = d.path().join("disk.ext4");
    ensure_template_disk(&root, &disk).unwrap();

    // The guest says why it gives up: launch quotes it.
    let failing = "#!/bin/busybox sh\necho 'space-daemon: failed no disk for you' >/dev/console\n/bin/busybox poweroff -f\n";
    let rt = shell_runtime(&d.path().join("a"), failing, Duration::from_secs(60));
    let p = plan(d.path(), "bad", Some(disk.clone()));
    let e = rt.launch(&p).await.unwrap_err().to_string();
    assert!(
        e.contains("guest did not become ready") && e.contains("no disk for you"),
        "{e}"
    );
    assert!(rt.boot_times("bad").is_none());
    assert!(!p.channel_socket.exists());

    // A kernel that came up without a timer interrupt (its init refuses): booted again. The
    // stand-in refuses on its first boot only (a mark on its disk); one that always refuses
    // fails the launch after three boots, quoting why.
    let mount = r#"$b mount -t ext4 /dev/vda /newroot || fail "mount /dev/vda""#;
    assert!(SHELL_INIT.contains(mount));
    let refuse = format!(
        "echo 'space-daemon: fatal: guest setup failed: {}: test'>/dev/console; \
         $b poweroff -f",
        space_proto::GUEST_NO_TIMER
    );
    let once = SHELL_INIT.replace(
        mount,
        &format!(
            "{mount}\nif [ ! -e /newroot/booted ]; then echo x >/newroot/booted; \
             $b umount /newroot; {refuse}; fi"
        ),
    );
    let rt = shell_runtime(&d.path().join("t"), &once, Duration::from_secs(60));
    let p = plan(d.path(), "notimer", Some(disk.clone()));
    let l = rt.launch(&p).await.unwrap();
    assert!(rt.alive(&l));
    rt.destroy("notimer", Some(&l)).await.unwrap();
    let never = SHELL_INIT.replace(mount, &format!("{mount}\n{refuse}"));
    let rt = shell_runtime(&d.path().join("u"), &never, Duration::from_secs(60));
    let p = plan(d.path(), "notimer2", Some(disk.clone()));
    let e = rt.launch(&p).await.unwrap_err().to_string();
    assert!(e.contains(space_proto::GUEST_NO_TIMER), "{e}");
    assert!(!p.channel_socket.exists());

    // A guest that never reports: launch gives up at the boot timeout and kills QEMU.
    let rt = shell_runtime(&d.path().join("b"), SHELL_INIT, Duration::from_millis(300));
    let p = plan(d.path(), "slow", Some(disk));
    let t0 = Instant::now();
    let e = rt.launch(&p).await.unwrap_err().to_string();
    assert!(e.contains("within 0.3 s"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    let qemus = Command::new("pgrep")
        .args(["-f", &p.channel_socket.display().to_string()])
        .output()
        .unwrap();
    assert!(qemus.stdout.is_empty(), "QEMU left running");
}

/// The static space-daemon the real-VM tests boot as init (`SPACE_DAEMON_STATIC`, else the
/// debug build `scripts/test` makes).
pub(super) fn static_daemon() -> PathBuf {
    let daemon = std::env::var_os("SPACE_DAEMON_STATIC")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../target/x86_64-unknown-linux-gnu/debug/space-daemon")
        });
    assert!(
        daemon.is_file(),
        "no static daemon at {}: RUSTFLAGS=\"-C target-feature=+crt-static\" cargo build \
         -p space-daemon --target x86_64-unknown-linux-gnu (or set SPACE_DAEMON_STATIC)",
        daemon.display()
    );
    daemon
}

/// The real space-daemon as init (its guest-init mode), reached through the node's connector.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vm_runs_space_daemon_as_init() {
    if let Some(why) = qemu_missing() {
        eprintln!("skipping the real space-daemon VM: {why}");
        return;
    }
    let daemon = static_daemon();
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("rootfs");
    small_rootfs(&root);
    fs::create_dir_all(root.join("bin")).unwrap();
    fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", root.join("bin/sh")).unwrap();
    let disk = d.path().join("disk.ext4");
    ensure_template_disk(&root, &disk).unwrap();
    let rt = MicrovmRuntime::new(MicrovmConfig {
        daemon_binary: daemon,
        work_dir: d.path().join("work"),
        boot_timeout: Duration::from_secs(60),
        ..MicrovmConfig::default()
    })
    .unwrap();
    let plan = plan(d.path(), "real", Some(disk));
    let t0 = Instant::now();
    let launched = match rt.launch(&plan).await {
        Ok(l) => l,
        Err(e) => panic!(
            "{e}\nconsole: {}",
            fs::read_to_string(plan.run_dir.join("console.log")).unwrap_or_default()
        ),
    };
    let launch = t0.elapsed();
    use crate::channel::GuestConnector;
    let mut client = crate::channel::UnixConnector::default()
        .connect(&plan.channel_socket)
        .await
        .unwrap()
        .client();
    let info = client
        .info(space_proto::InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    eprintln!(
        "launch {launch:?}, launch to Info {:?}, {}; guest kernel {}",
        t0.elapsed(),
        rt.accel_note(),
        info.kernel_release
    );
    assert_eq!(info.kernel_release, rt.kernel_version());
    rt.destroy("real", Some(&launched)).await.unwrap();
    assert!(!rt.alive(&launched));
}

/// The QEMU cgroup directories of VM `id` under the test parent (v1: per controller).
fn test_cgroup_dirs(id: &str) -> Vec<PathBuf> {
    crate::cgroup::LinuxCgroups::detect(Path::new("/sys/fs/cgroup"), "space-vm-test")
        .unwrap()
        .dirs(id)
}

fn status_field(status: &str, key: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} in {status}"))
        .trim()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vm_runs_jailed() {
    if let Some(why) = qemu_missing() {
        eprintln!("skipping the jailed microvm: {why}");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("rootfs");
    small_rootfs(&root);
    let disk = d.path().join("disk.ext4");
    ensure_template_disk(&root, &disk).unwrap();
    let rt = shell_runtime(&d.path().join("w"), SHELL_INIT, Duration::from_secs(60));
    let mut plan = plan(d.path(), "jailed1", Some(disk.clone()));
    plan.uid_base = 1_234_567_000;
    let launched = rt.launch(&plan).await.unwrap();
    let pid = launched.init_pid;

    // Its own uid/gid, no groups, seccomp filter mode, no_new_privs, no capabilities.
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert_eq!(
        status_field(&status, "Uid:"),
        "1234567000\t1234567000\t1234567000\t1234567000"
    );
    assert_eq!(
        status_field(&status, "Gid:"),
        "1234567000\t1234567000\t1234567000\t1234567000"
    );
    assert_eq!(status_field(&status, "Groups:"), "");
    assert_eq!(status_field(&status, "Seccomp:"), "2");
    assert_eq!(status_field(&status, "NoNewPrivs:"), "1");
    assert_eq!(status_field(&status, "CapEff:"), "0000000000000000");
    assert_eq!(status_field(&status, "CapPrm:"), "0000000000000000");
    // Its files are its own.
    assert_eq!(fs::metadata(&disk).unwrap().uid(), 1_234_567_000);
    assert_eq!(fs::metadata(&plan.run_dir).unwrap().uid(), 1_234_567_000);

    // Its own mount, IPC, UTS and (without a slot: a fresh, empty) network namespace,
    // holding its tap as an inherited descriptor and no /dev/net/tun.
    let ns = |p: &str, n: &str| fs::read_link(format!("/proc/{p}/ns/{n}")).unwrap();
    for n in ["mnt", "ipc", "uts", "net"] {
        assert_ne!(ns(&pid.to_string(), n), ns("self", n), "{n}");
    }
    let fds: Vec<String> = fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| fs::read_link(e.unwrap().path()).ok())
        .map(|l| l.display().to_string())
        .collect();
    assert!(fds.iter().any(|l| l == "/dev/net/tun"), "no tap: {fds:?}");
    let net_dev = fs::read_to_string(format!("/proc/{pid}/net/dev")).unwrap();
    let ifaces: Vec<&str> = net_dev
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    assert_eq!(ifaces.len(), 2, "only lo and the tap: {net_dev}");
    assert!(
        ifaces.contains(&"lo") && ifaces.contains(&"tap0"),
        "{net_dev}"
    );
    assert_eq!(ns(&pid.to_string(), "pid"), ns("self", "pid"));

    // Only the expected mounts.
    let mountinfo = fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    let points: Vec<String> = mountinfo
        .lines()
        .map(|l| l.split(' ').nth(4).unwrap().to_owned())
        .collect();
    let initrd = fs::canonicalize(rt.initramfs()).unwrap();
    let kernel = fs::canonicalize(Path::new(DEFAULT_VM_DIR).join("vmlinuz")).unwrap();
    let mut allowed: Vec<PathBuf> = vec![
        "/".into(),
        "/usr".into(),
        "/etc/ld.so.cache".into(),
        "/dev/null".into(),
        "/dev/urandom".into(),
        "/dev/kvm".into(),
        disk.clone(),
        plan.run_dir.clone(),
        initrd.clone(),
        kernel,
    ];
    allowed.extend(["/lib", "/lib64", "/lib32", "/bin", "/sbin"].map(PathBuf::from));
    for p in &points {
        assert!(
            allowed
                .iter()
                .any(|a| Path::new(p) == a || Path::new(p).starts_with("/usr/")),
            "unexpected mount {p} in the jail:\n{mountinfo}"
        );
    }
    for must in [
        disk.as_path(),
        plan.run_dir.as_path(),
        initrd.as_path(),
        Path::new("/usr"),
    ] {
        assert!(
            points.iter().any(|p| Path::new(p) == must),
            "{} not mounted:\n{mountinfo}",
            must.display()
        );
    }
    for never in ["/home", "/root", "/var/lib/space", "/proc", "/sys", "/tmp"] {
        assert!(!points.iter().any(|p| p == never), "{never} is in the jail");
    }
    // The root is a read-only tmpfs; /usr is read-only.
    let line_of = |point: &str| {
        mountinfo
            .lines()
            .find(|l| l.split(' ').nth(4) == Some(point))
            .unwrap()
            .to_owned()
    };
    assert!(
        line_of("/").contains(" - tmpfs ")
            && line_of("/").split(' ').nth(5).unwrap().starts_with("ro"),
        "{}",
        line_of("/")
    );
    assert!(line_of("/usr").split(' ').nth(5).unwrap().starts_with("ro"));

    // In its cgroup, with the memory limit of its RAM plus overhead.
    let dirs = test_cgroup_dirs("jailed1");
    for dir in &dirs {
        let procs = fs::read_to_string(dir.join("cgroup.procs")).unwrap();
        assert!(
            procs.lines().any(|l| l == pid.to_string()),
            "{} lacks {pid}",
            dir.display()
        );
    }
    let want = (256 + jail::OVERHEAD_MIB + jail::TCG_TB_MIB) << 20;
    let mem_dir = dirs
        .iter()
        .find(|d| d.starts_with("/sys/fs/cgroup/memory"))
        .cloned();
    let limit = match &mem_dir {
        Some(m) => fs::read_to_string(m.join("memory.limit_in_bytes")).unwrap(),
        None => fs::read_to_string(dirs[0].join("memory.max")).unwrap(),
    };
    if rt.accel() == "tcg" {
        assert_eq!(limit.trim(), want.to_string());
    }
    let used = rt.memory_bytes("jailed1").unwrap();
    assert!(used > 10 << 20, "cgroup memory {used}");
    assert!(rt.cpu_usage_usec("jailed1").unwrap() > 0);

    // The channel still works from the host.
    let mut ch = UnixStream::connect(&plan.channel_socket).unwrap();
    ch.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    ch.write_all(b"jailed ping\n").unwrap();
    let mut got = vec![0u8; 12];
    ch.read_exact(&mut got).unwrap();
    assert_eq!(got, b"jailed ping\n");
    rt.set_frozen("jailed1", true).await.unwrap();
    rt.set_frozen("jailed1", false).await.unwrap();

    rt.destroy("jailed1", Some(&launched)).await.unwrap();
    assert!(!rt.alive(&launched));
    for dir in &dirs {
        assert!(!dir.exists(), "{} left behind", dir.display());
    }
}

/// A VM started by an earlier runtime (a node restart) is still reached, paused and destroyed,
/// and its cgroup goes with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_jailed_vm_survives_a_runtime_restart() {
    if let Some(why) = qemu_missing() {
        eprintln!("skipping the adopted jailed microvm: {why}");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("rootfs");
    small_rootfs(&root);
    let disk = d.path().join("disk.ext4");
    ensure_template_disk(&root, &disk).unwrap();
    let work = d.path().join("w");
    let plan = {
        let mut p = plan(d.path(), "jailed2", Some(disk));
        // run_root of shell_runtime is <work>/run.
        p.run_dir = work.join("run").join("jailed2");
        p.channel_socket = p.run_dir.join("guest.sock");
        p
    };
    // An init that stays up without a host on its channel and without spinning.
    let init = SHELL_INIT.replace(
        "while :; do $b cat <&3 >&3; $b usleep 20000; done",
        "exec $b sleep 100000",
    );
    assert_ne!(init, SHELL_INIT);
    let rt = shell_runtime(&work, &init, Duration::from_secs(60));
    let launched = rt.launch(&plan).await.unwrap();
    drop(rt);
    let rt = shell_runtime(&work, &init, Duration::from_secs(60));
    assert!(
        rt.alive(&launched),
        "QEMU gone after the restart: {:?} {:?}; qemu.log {:?}",
        qemu::read_stat(launched.init_pid),
        launched,
        fs::read_to_string(plan.run_dir.join("qemu.log"))
    );
    rt.set_frozen("jailed2", true).await.unwrap();
    assert!(rt.is_frozen("jailed2"));
    rt.set_frozen("jailed2", false).await.unwrap();
    assert!(rt.memory_bytes("jailed2").unwrap() > 10 << 20);
    let dirs = test_cgroup_dirs("jailed2");
    rt.destroy("jailed2", Some(&launched)).await.unwrap();
    assert!(!rt.alive(&launched));
    assert!(dirs.iter().all(|d| !d.exists()));
}

/// What the jail adds to a launch: the median start-to-QMP-ready of a few launches, jailed and
/// not (printed; the bound only catches a gross regression).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vm_jail_launch_cost() {
    if let Some(why) = qemu_missing() {
        eprintln!("skipping the jail cost measurement: {why}");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("rootfs");
    small_rootfs(&root);
    let disk = d.path().join("disk.ext4");
    ensure_template_disk(&root, &disk).unwrap();
    let mut medians = Vec::new();
    for jailed in [false, true] {
        let work = d.path().join(if jailed { "j" } else { "n" });
        let rt = shell_runtime_jailed(&work, SHELL_INIT, Duration::from_secs(60), jailed);
        let mut qmp = Vec::new();
        let mut spawn = Vec::new();
        let mut ready = Vec::new();
        for i in 0..5 {
            let id = format!("cost{i}");
            let p = plan(&work, &id, Some(disk.clone()));
            let l = rt.launch(&p).await.unwrap();
            let t = rt.boot_times(&id).unwrap();
            qmp.push(t.spawn + t.qmp_ready);
            spawn.push(t.spawn);
            ready.push(t.guest_ready);
            rt.destroy(&id, Some(&l)).await.unwrap();
        }
        qmp.sort();
        spawn.sort();
        ready.sort();
        eprintln!(
            "jailed={jailed}: spawn call median {:?} {spawn:?}; start to QMP ready median {:?} \
             {qmp:?}; spawn end to guest ready median {:?}",
            spawn[2], qmp[2], ready[2]
        );
        medians.push(qmp[2]);
    }
    eprintln!(
        "the jail adds {:?} to start-to-QMP-ready (medians)",
        medians[1].saturating_sub(medians[0])
    );
    assert!(medians[1] < medians[0] + Duration::from_secs(1));
}
