//! Memory checkpoints with real VMs (SPACE_REQUIRE_QEMU=1) running the real space-daemon, and
//! the command-line and jail pieces without them.

use std::process::Command;

use crate::api::GuestChannel;
use space_proto::guest_client::GuestClient;
use space_proto::{ExecRequest, InfoRequest, ListProcessesRequest, process_event};

use sha2::Digest;

use super::checkpoint::{
    MAX_STATE_BYTES, MEM_FILE, PRIVATE_MEM_FILE, RestoreMode, STATE_FILE, STATE_SUM_FILE,
};
use super::*;
use crate::channel::{GuestConnector, UnixConnector};

use super::tests::strings;

fn spec() -> VmSpec {
    jail::tests::spec(AccelKind::Tcg)
}

#[test]
fn file_backed_ram_and_incoming_on_the_command_line() {
    let plain = strings(spec().args());
    assert!(!plain.iter().any(|a| a.contains("memory-backend")));
    assert!(!plain.iter().any(|a| a == "-incoming"));
    let mem = Path::new("/dev/shm/space/a,b.mem");
    let a = strings(spec().args_with(Extras {
        memory_file: Some(mem),
        incoming: true,
        private_memory: false,
        tap_fd: None,
    }));
    let m = a.iter().position(|x| x == "-M").unwrap();
    assert!(a[m + 1].ends_with(",memory-backend=ram0"), "{}", a[m + 1]);
    let o = a.iter().position(|x| x == "-object").unwrap();
    assert_eq!(
        a[o + 1],
        "memory-backend-file,id=ram0,size=256M,share=on,mem-path=/dev/shm/space/a,,b.mem"
    );
    let i = a.iter().position(|x| x == "-incoming").unwrap();
    assert_eq!(a[i + 1], "defer");
    let p = strings(spec().args_with(Extras {
        memory_file: Some(mem),
        incoming: true,
        private_memory: true,
        tap_fd: None,
    }));
    let o = p.iter().position(|x| x == "-object").unwrap();
    assert_eq!(
        p[o + 1],
        "memory-backend-file,id=ram0,size=256M,share=off,mem-path=/dev/shm/space/a,,b.mem"
    );
}

#[test]
fn the_jail_binds_the_memory_file_alone_read_write() {
    use space_sys::jail::{BindMode, JailOp};
    let mem = Path::new("/proc/self/exe");
    let ops = jail::ops_with(
        Path::new("/usr/bin/qemu-system-x86_64"),
        &spec(),
        Path::new("/run/space/sandboxes/abc"),
        Some(mem),
    )
    .unwrap();
    assert!(ops.iter().any(|o| matches!(o,
        JailOp::Bind { src, dst, mode: BindMode::ReadWrite } if src == mem && dst == mem)));
    assert!(
        !ops.iter()
            .any(|o| matches!(o, JailOp::Bind { dst, .. } if dst == Path::new("/proc/self")))
    );
}

#[test]
fn memory_copies_keep_holes_and_contents() {
    use std::os::unix::fs::{FileExt, MetadataExt};
    let d = tempfile::tempdir_in("/dev/shm").unwrap();
    let src = d.path().join("a.mem");
    let f = fs::File::create(&src).unwrap();
    f.set_len(64 << 20).unwrap();
    f.write_all_at(&[1u8; 8192], 4096).unwrap();
    f.write_all_at(&[2u8; 4096], (64 << 20) - 4096).unwrap();
    let dst = d.path().join("b.mem");
    // tmpfs cannot reflink: the data ranges are copied, the holes stay holes.
    assert_eq!(
        checkpoint::copy_memory(&src, &dst).unwrap(),
        MemoryCopy::Copy
    );
    assert_eq!(fs::read(&src).unwrap(), fs::read(&dst).unwrap());
    let m = fs::metadata(&dst).unwrap();
    assert_eq!(m.len(), 64 << 20);
    assert!(
        m.blocks() * 512 <= 64 << 10,
        "{} bytes allocated",
        m.blocks() * 512
    );
    // An existing destination is never overwritten.
    assert!(checkpoint::copy_memory(&src, &dst).is_err());
    assert_eq!(fs::read(&src).unwrap(), fs::read(&dst).unwrap());
}

/// Why real VMs cannot run here (None: they can); panics under SPACE_REQUIRE_QEMU=1.
fn real_vms() -> Option<PathBuf> {
    let required = std::env::var("SPACE_REQUIRE_QEMU").as_deref() == Ok("1");
    if !required {
        eprintln!("skipping: SPACE_REQUIRE_QEMU is not 1 (real VMs take seconds under TCG)");
        return None;
    }
    assert!(
        GuestKernel::locate(Path::new(DEFAULT_VM_DIR)).is_ok(),
        "SPACE_REQUIRE_QEMU=1 but no guest kernel in {DEFAULT_VM_DIR}"
    );
    Some(super::tests::static_daemon())
}

/// A disk holding busybox as /bin/sh.
fn busybox_disk(dir: &Path) -> PathBuf {
    let root = dir.join("rootfs");
    fs::create_dir_all(root.join("etc")).unwrap();
    fs::create_dir_all(root.join("bin")).unwrap();
    fs::write(root.join("etc/hostname"), "space\n").unwrap();
    fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", root.join("bin/sh")).unwrap();
    let disk = dir.join("disk.ext4");
    ensure_template_disk(&root, &disk).unwrap();
    disk
}

fn runtime(daemon: &Path, work: &Path, memory_dir: &Path) -> MicrovmRuntime {
    MicrovmRuntime::new(MicrovmConfig {
        daemon_binary: daemon.to_path_buf(),
        work_dir: work.join("work"),
        boot_timeout: Duration::from_secs(60),
        cgroup_parent: "space-vm-test".to_owned(),
        run_root: Some(work.join("run")),
        memory_dir: Some(memory_dir.to_path_buf()),
        ..MicrovmConfig::default()
    })
    .unwrap()
}

fn plan(dir: &Path, id: &str, disk: PathBuf, memory_mib: u64) -> LaunchPlan {
    let run_dir = dir.join("run").join(id);
    LaunchPlan {
        id: id.to_owned(),
        rootfs: dir.join("unused-rootfs"),
        uid_base: 1_000_000_000,
        id_count: 65536,
        hostname: id.to_owned(),
        limits: Limits {
            cpu_millis: 1000,
            memory_mib,
            pids: 256,
            rlimits: Default::default(),
            disk_mib: None,
        },
        env: Vec::new(),
        daemon_binary: dir.join("unused-daemon"),
        channel_socket: run_dir.join("guest.sock"),
        run_dir,
        netns: None,
        disk: Some(disk),
    }
}

/// A copy of `src` made while its VM is paused (each VM needs its own disk).
fn copy_disk(src: &Path, dst: &Path) -> PathBuf {
    if clone_disk(src, dst).is_err() {
        fs::copy(src, dst).unwrap();
    }
    dst.to_path_buf()
}

/// A channel client; three tries of the node's 5 s connect (several TCG guests share two
/// cores in the parallel test run).
async fn client(socket: &Path) -> GuestClient<GuestChannel> {
    let mut last = None;
    for i in 0..3 {
        match UnixConnector::default().connect(socket).await {
            Ok(c) => return c.client(),
            Err(e) => {
                eprintln!("connect #{i} to {}: {e}", socket.display());
                last = Some(e);
            }
        }
    }
    panic!("no channel at {}: {:?}", socket.display(), last);
}

/// Runs `argv` to its end; (exit code, output).
async fn exec(c: &mut GuestClient<GuestChannel>, argv: &[&str]) -> (i32, String) {
    let mut s = c
        .exec(ExecRequest {
            argv: argv.iter().map(|a| a.to_string()).collect(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    while let Some(ev) = s.message().await.unwrap() {
        match ev.event {
            Some(process_event::Event::Output(o)) => out.extend_from_slice(&o.data),
            Some(process_event::Event::Exit(e)) => {
                return (e.code, String::from_utf8_lossy(&out).into_owned());
            }
            _ => {}
        }
    }
    panic!("{argv:?} ended without an exit event");
}

/// The counter's value (0 before its first write).
async fn counter(c: &mut GuestClient<GuestChannel>) -> u64 {
    let (_, out) = exec(c, &["/bin/busybox", "cat", "/counter"]).await;
    out.trim().parse().unwrap_or(0)
}

/// The pids of running processes whose argv mentions `needle`.
async fn running(c: &mut GuestClient<GuestChannel>, needle: &str) -> Vec<u32> {
    let l = c
        .list_processes(ListProcessesRequest {})
        .await
        .unwrap()
        .into_inner();
    l.processes
        .iter()
        .filter(|p| p.running && p.argv.iter().any(|a| a.contains(needle)))
        .map(|p| p.pid)
        .collect()
}

const COUNTER: &str =
    "i=0; while true; do i=$((i+1)); echo $i > /counter; /bin/busybox usleep 50000; done";

async fn wait_counter_moves(c: &mut GuestClient<GuestChannel>) -> (u64, u64) {
    let a = counter(c).await;
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let b = counter(c).await;
        if b > a {
            return (a, b);
        }
    }
    panic!("the counter stays at {a}");
}

fn qemus_on(socket: &Path) -> String {
    let out = Command::new("pgrep")
        .args(["-af", &socket.display().to_string()])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A running VM is checkpointed and restored twice (a fork): both copies go on with the same
/// boot and the same counting process; a corrupted state file is refused, leaving nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vm_checkpoint_forks_and_refuses_corrupt_state() {
    let Some(daemon) = real_vms() else { return };
    let d = tempfile::tempdir().unwrap();
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    let disk = busybox_disk(d.path());
    let rt = runtime(&daemon, d.path(), shm.path());
    let src = plan(d.path(), "src", disk, 256);
    let launched = rt.launch(&src).await.unwrap();
    let mem = rt.memory_file_of("src").unwrap();
    assert_eq!(fs::metadata(&mem).unwrap().len(), 256 << 20);
    let mut c = client(&src.channel_socket).await;
    let info = c.info(InfoRequest {}).await.unwrap().into_inner();
    let started = c
        .start(ExecRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), COUNTER.into()],
            tag: "counter".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .pid;
    wait_counter_moves(&mut c).await;

    // Checkpoint, left paused so that the disk copies match the memory.
    let ck = d.path().join("ck");
    let ci = rt.checkpoint("src", &ck, false).await.unwrap();
    eprintln!("checkpoint: {ci:?}");
    assert!(rt.is_frozen("src"));
    assert_eq!(ci.mem_bytes, 256 << 20);
    assert_eq!(ci.mem_copy, MemoryCopy::Copy, "tmpfs cannot reflink");
    assert!(
        ci.state_bytes > 1024 && ci.state_bytes < 4 << 20,
        "device state only: {} bytes",
        ci.state_bytes
    );
    assert_eq!(
        fs::metadata(ck.join(STATE_FILE)).unwrap().len(),
        ci.state_bytes
    );
    let disks: Vec<PathBuf> = ["fork1", "fork2"]
        .iter()
        .map(|f| {
            copy_disk(
                src.disk.as_deref().unwrap(),
                &d.path().join(format!("{f}.ext4")),
            )
        })
        .collect();
    // A second checkpoint into the same dir is refused.
    let e = rt
        .checkpoint("src", &ck, false)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs an empty directory"), "{e}");
    // So is one of a VM still stopped by a checkpoint (QEMU is in `postmigrate`).
    let e = rt
        .checkpoint("src", &d.path().join("ck2"), false)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("resume it before the next"), "{e}");
    rt.set_frozen("src", false).await.unwrap();

    let mut forks = Vec::new();
    for (i, disk) in disks.into_iter().enumerate() {
        let p = plan(d.path(), &format!("fork{}", i + 1), disk, 256);
        let (l, t) = rt
            .restore_timed(&p, &ck, RestoreMode::Shared)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "{e}\nconsole: {}",
                    fs::read_to_string(p.run_dir.join("console.log")).unwrap_or_default()
                )
            });
        eprintln!("restore {}: {t:?}", p.id);
        assert_ne!(rt.memory_file_of(&p.id).unwrap(), mem);
        forks.push((p, l));
    }
    // The source goes on too (QEMU serves one host connection at a time: the old one goes).
    drop(c);
    let mut c = client(&src.channel_socket).await;
    wait_counter_moves(&mut c).await;
    drop(c);
    for (p, _) in &forks {
        let mut c = client(&p.channel_socket).await;
        let fi = c.info(InfoRequest {}).await.unwrap().into_inner();
        assert_eq!(fi.boot_id, info.boot_id, "{}: same boot", p.id);
        assert_eq!(fi.started_unix_ms, info.started_unix_ms);
        assert_eq!(running(&mut c, "/counter").await, vec![started], "{}", p.id);
        let (a, b) = wait_counter_moves(&mut c).await;
        eprintln!("{} counts on: {a} -> {b}", p.id);
    }
    // Each fork has its own memory: a file written in one is not in the other.
    {
        let mut c1 = client(&forks[0].0.channel_socket).await;
        let mut c2 = client(&forks[1].0.channel_socket).await;
        let (code, _) = exec(&mut c1, &["/bin/sh", "-c", "echo one > /dev/shm-test"]).await;
        assert_eq!(code, 0);
        let (code, _) = exec(&mut c2, &["/bin/busybox", "cat", "/dev/shm-test"]).await;
        assert_ne!(code, 0, "fork2 sees fork1's file");
    }

    // A VM restored with its RAM mapped privately cannot leave RAM out of its checkpoint:
    // the RAM goes into the stream, and a restore of that gets a memory file of its own.
    let priv_dir = d.path().join("priv");
    fs::create_dir_all(&priv_dir).unwrap();
    let pp = plan(
        d.path(),
        "priv",
        copy_disk(
            forks[0].0.disk.as_deref().unwrap(),
            &priv_dir.join("disk.ext4"),
        ),
        256,
    );
    let (pl, _) = rt
        .restore_timed(&pp, &ck, RestoreMode::Private)
        .await
        .unwrap();
    assert!(priv_dir.join(PRIVATE_MEM_FILE).exists());
    assert!(!rt.memory_file_of("priv").unwrap().exists());
    let mut c = client(&pp.channel_socket).await;
    wait_counter_moves(&mut c).await;
    let ck2 = d.path().join("ck-in-stream");
    let ci2 = rt.checkpoint("priv", &ck2, true).await.unwrap();
    eprintln!("checkpoint of a privately mapped VM: {ci2:?}");
    assert_eq!(ci2.mem_copy, MemoryCopy::InStream);
    assert!(!ck2.join(MEM_FILE).exists());
    assert!(
        ci2.state_bytes > 4 << 20 && ci2.state_bytes < (256 << 20) + MAX_STATE_BYTES,
        "RAM in the stream: {} bytes",
        ci2.state_bytes
    );
    let pp2 = plan(
        d.path(),
        "priv2",
        copy_disk(pp.disk.as_deref().unwrap(), &d.path().join("priv2.ext4")),
        256,
    );
    let (pl2, t2) = rt
        .restore_timed(&pp2, &ck2, RestoreMode::Shared)
        .await
        .unwrap();
    eprintln!("restore of a stream with RAM: {t2:?}");
    assert_eq!(t2.mem_copy, MemoryCopy::InStream);
    assert!(
        rt.memory_file_of("priv2").unwrap().exists(),
        "a memory file of its own"
    );
    drop(c);
    let mut c = client(&pp2.channel_socket).await;
    assert_eq!(running(&mut c, "/counter").await, vec![started]);
    wait_counter_moves(&mut c).await;
    drop(c);
    // And that one leaves RAM out of its own checkpoint again.
    let ck3 = d.path().join("ck3");
    let ci3 = rt.checkpoint("priv2", &ck3, true).await.unwrap();
    assert_ne!(ci3.mem_copy, MemoryCopy::InStream);
    rt.destroy("priv", Some(&pl)).await.unwrap();
    rt.destroy("priv2", Some(&pl2)).await.unwrap();

    // A corrupted state file: refused by its checksum before any QEMU starts.
    let bad = d.path().join("bad");
    fs::create_dir_all(&bad).unwrap();
    fs::copy(ck.join(MEM_FILE), bad.join(MEM_FILE)).unwrap();
    let mut state = fs::read(ck.join(STATE_FILE)).unwrap();
    let mid = state.len() / 2;
    for b in &mut state[mid..mid + 256] {
        *b ^= 0x5a;
    }
    fs::write(bad.join(STATE_FILE), &state).unwrap();
    fs::copy(ck.join(STATE_SUM_FILE), bad.join(STATE_SUM_FILE)).unwrap();
    let p = plan(
        d.path(),
        "corrupt",
        copy_disk(
            forks[0].0.disk.as_deref().unwrap(),
            &d.path().join("c.ext4"),
        ),
        256,
    );
    let e = rt.restore(&p, &bad).await.unwrap_err().to_string();
    assert!(e.contains("is corrupted: its SHA-256 is"), "{e}");
    assert!(!p.run_dir.join("qemu.log").exists(), "no QEMU started");
    // A stream QEMU itself rejects (cut short, with a matching checksum): QEMU exits, and
    // nothing is left running.
    state = fs::read(ck.join(STATE_FILE)).unwrap();
    state.truncate(state.len() / 2);
    fs::write(bad.join(STATE_FILE), &state).unwrap();
    let sum = format!("{:x}\n", sha2::Sha256::digest(&state));
    fs::write(bad.join(STATE_SUM_FILE), sum).unwrap();
    let t0 = Instant::now();
    let e = rt.restore(&p, &bad).await.unwrap_err().to_string();
    eprintln!("cut state: {e} ({:?})", t0.elapsed());
    assert!(e.contains("refused the checkpoint's device state"), "{e}");
    assert!(qemus_on(&p.channel_socket).is_empty(), "QEMU left running");
    assert!(!rt.memory_file_of("corrupt").unwrap().exists());
    assert!(!p.channel_socket.exists());
    // Truncated to nothing: refused before any QEMU starts.
    fs::write(bad.join(STATE_FILE), b"").unwrap();
    let e = rt.restore(&p, &bad).await.unwrap_err().to_string();
    assert!(e.contains("this state file may hold 1 to"), "{e}");
    // A plan with another memory size.
    let p2 = plan(d.path(), "other", p.disk.clone().unwrap(), 512);
    let e = rt.restore(&p2, &ck).await.unwrap_err().to_string();
    assert!(e.contains("needs the checkpointed VM's memory size"), "{e}");

    for (p, l) in &forks {
        rt.destroy(&p.id, Some(l)).await.unwrap();
        assert!(!rt.memory_file_of(&p.id).unwrap().exists());
    }
    rt.destroy("src", Some(&launched)).await.unwrap();
    assert!(!mem.exists());
}

/// A small btrfs filesystem on a loop device, unmounted on drop.
struct BtrfsLoop {
    mnt: PathBuf,
    _dir: tempfile::TempDir,
}

impl BtrfsLoop {
    fn new(bytes: u64) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("btrfs.img");
        fs::File::create(&img).unwrap().set_len(bytes).unwrap();
        let ok = Command::new("mkfs.btrfs")
            .arg("-q")
            .arg(&img)
            .status()
            .unwrap();
        assert!(ok.success(), "mkfs.btrfs failed");
        let mnt = dir.path().join("mnt");
        fs::create_dir_all(&mnt).unwrap();
        let ok = Command::new("mount")
            .args(["-o", "loop"])
            .arg(&img)
            .arg(&mnt)
            .status()
            .unwrap();
        assert!(ok.success(), "mounting a btrfs loop image failed");
        Self { mnt, _dir: dir }
    }
}

impl Drop for BtrfsLoop {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mnt).status();
    }
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn extents(p: &Path) -> String {
    let out = Command::new("filefrag").arg(p).output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Dirty bytes of the host's page cache (`Dirty:` + `Writeback:` in /proc/meminfo).
fn host_dirty_kib() -> u64 {
    let m = fs::read_to_string("/proc/meminfo").unwrap();
    m.lines()
        .filter(|l| l.starts_with("Dirty:") || l.starts_with("Writeback:"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

/// The figures of decision 0014's "Memory checkpoints": median of 5 saves and restores with
/// the memory file on tmpfs and on btrfs, and what a guest writing 200 MiB of memory costs
/// on each (printed; the bounds only catch gross regressions).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vm_checkpoint_costs() {
    let Some(daemon) = real_vms() else { return };
    let d = tempfile::tempdir().unwrap();
    let disk = busybox_disk(d.path());
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    let btrfs = BtrfsLoop::new(3 << 30);
    for (name, memdir) in [
        ("tmpfs", shm.path().to_path_buf()),
        ("btrfs", btrfs.mnt.join("mem")),
    ] {
        let work = d.path().join(name);
        let rt = runtime(&daemon, &work, &memdir);
        let ckroot = if name == "btrfs" {
            btrfs.mnt.join("ck")
        } else {
            work.join("ck")
        };
        let src = plan(
            &work,
            "cost-src",
            copy_disk(&disk, &work.join("src.ext4")),
            384,
        );
        fs::create_dir_all(&work).ok();
        let l = rt.launch(&src).await.unwrap();
        let mut c = client(&src.channel_socket).await;
        // The long-running cost: the guest writes 200 MiB of its memory, three times.
        let mut write = Vec::new();
        let dirty0 = host_dirty_kib();
        let mut dirty_peak = 0;
        for _ in 0..3 {
            let t0 = Instant::now();
            let (code, out) = exec(
                &mut c,
                &[
                    "/bin/busybox",
                    "dd",
                    "if=/dev/zero",
                    "of=/dev/null",
                    "bs=200M",
                    "count=1",
                ],
            )
            .await;
            assert_eq!(code, 0, "{out}");
            write.push(t0.elapsed());
            dirty_peak = dirty_peak.max(host_dirty_kib());
        }
        let mem = rt.memory_file_of("cost-src").unwrap();
        let t0 = Instant::now();
        fs::File::open(&mem).unwrap().sync_all().unwrap();
        let flush = t0.elapsed();
        eprintln!(
            "{name}: guest writes 200 MiB in {write:?}; host dirty+writeback {} -> peak {} KiB; \
             fsync of the memory file after {flush:?}; {}",
            dirty0,
            dirty_peak,
            extents(&mem)
        );
        let mut saves = Vec::new();
        let mut mems = Vec::new();
        let mut restores = Vec::new();
        let mut sizes = Vec::new();
        for i in 0..5 {
            let ck = ckroot.join(format!("{i}"));
            let ci = rt.checkpoint("cost-src", &ck, true).await.unwrap();
            saves.push(ci.save + ci.pause);
            mems.push(ci.mem);
            sizes.push(ci.state_bytes);
            let p = plan(
                &work,
                &format!("cost-r{i}"),
                copy_disk(&disk, &work.join(format!("r{i}.ext4"))),
                384,
            );
            let t0 = Instant::now();
            let (rl, t) = rt
                .restore_timed(&p, &ck, RestoreMode::Shared)
                .await
                .unwrap();
            restores.push(t0.elapsed());
            eprintln!("{name} #{i}: {ci:?}; restore {t:?}");
            rt.destroy(&p.id, Some(&rl)).await.unwrap();
            // Dirty the source between checkpoints, as a running VM would.
            let (code, _) = exec(
                &mut c,
                &[
                    "/bin/busybox",
                    "dd",
                    "if=/dev/zero",
                    "of=/dev/null",
                    "bs=64M",
                    "count=1",
                ],
            )
            .await;
            assert_eq!(code, 0);
        }
        eprintln!(
            "{name}: save (pause + device state) median {:?}, memory copy median {:?} ({:?}), \
             state {sizes:?} bytes, restore to serving median {:?}; memory file after: {}",
            median(&mut saves),
            median(&mut mems),
            rt.checkpoint("cost-src", &ckroot.join("last"), true)
                .await
                .unwrap()
                .mem_copy,
            median(&mut restores),
            extents(&mem)
        );
        rt.destroy("cost-src", Some(&l)).await.unwrap();
    }
}
