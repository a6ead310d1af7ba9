//! The control plane and the node survive crashes and restarts: sandboxes outlive spaced, are
//! re-adopted, and the reconciler notices sandboxes whose init died.

use std::time::{Duration, Instant};

use serde_json::Value;
use space_tests::{Spaced, on_each_runtime};

fn state_of(s: &Spaced, id: &str) -> String {
    let v: Value = serde_json::from_str(&s.space_ok(&["inspect", id])).unwrap();
    v["state"].as_str().unwrap_or("").to_string()
}

on_each_runtime! {
fn kill9_and_graceful_restart_keep_sandboxes(rt) {
    let mut s = Spaced::start_on(rt).unwrap();
    let id = s.create(&[]);
    let pid = s.space_ok(&[
        "exec",
        "-d",
        &id,
        "--",
        "sh",
        "-c",
        "i=0; while true; do echo $i; i=$((i+1)); sleep 0.05; done",
    ]);
    let pid = pid.trim().to_string();
    s.sh(&id, "echo kept > /root/state");

    // Crash: SIGKILL spaced. The sandbox and its background process keep running.
    s.kill9();
    std::thread::sleep(Duration::from_millis(300));
    s.spawn().unwrap();
    assert_eq!(state_of(&s, &id), "running");
    assert_eq!(
        s.space_ok(&["exec", &id, "--", "cat", "/root/state"]),
        "kept\n"
    );
    let ps = s.space_ok(&["ps", &id]);
    assert!(
        ps.contains(&pid),
        "background process lost across the crash: {ps}"
    );

    // Graceful stop and start: same.
    let st = s.stop().unwrap();
    assert!(st.success(), "spaced exit status {st}");
    s.spawn().unwrap();
    assert_eq!(state_of(&s, &id), "running");
    assert_eq!(
        s.space_ok(&["exec", &id, "--", "cat", "/root/state"]),
        "kept\n"
    );
    s.space_ok(&["kill", &id, &pid]);
}
}

fn init_pid(s: &Spaced, id: &str) -> u64 {
    let info: Value = serde_json::from_str(&s.space_ok(&["inspect", id])).unwrap();
    info["init_pid"]
        .as_u64()
        .expect("inspect shows the init's host pid")
}

fn wait_running(s: &Spaced, id: &str, secs: u64) -> Duration {
    let start = Instant::now();
    let deadline = start + Duration::from_secs(secs);
    loop {
        let st = state_of(s, id);
        if st == "running" && s.space(&["exec", id, "--", "true"]).status.success() {
            return start.elapsed();
        }
        assert!(
            Instant::now() < deadline,
            "{id} still {st} after {secs} s:\n{}",
            s.log_tail()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn sandbox_whose_init_died_is_restarted_from_its_newest_snapshot() {
    let s = Spaced::start().unwrap();
    let id = s.create(&[]);
    s.sh(&id, "echo one > /root/one");
    s.space_ok(&["snapshot", &id]);
    s.sh(&id, "echo two > /root/two");
    let snap = s.space_ok(&["snapshot", &id]).trim().to_string();
    s.sh(&id, "echo after > /root/after");
    let old_init = init_pid(&s, &id);
    // Kill the sandbox's init from the host, behind spaced's back.
    std::process::Command::new("kill")
        .args(["-9", &old_init.to_string()])
        .status()
        .unwrap();
    let took = wait_running(&s, &id, 30);
    eprintln!("recovered {took:?} after the init's death");
    assert_ne!(init_pid(&s, &id), old_init);
    // The newest snapshot's files are there; writes after it are gone (decision 0009).
    assert_eq!(s.sh(&id, "cat /root/one /root/two").1, "one\ntwo\n");
    assert_ne!(s.sh(&id, "cat /root/after").0, 0);
    let events = s.space_ok(&["events", &id]);
    let rec = events
        .lines()
        .find(|l| l.contains("recovered"))
        .unwrap_or_else(|| panic!("no recovery event:\n{events}"));
    assert!(rec.contains(&format!("snapshot={snap}")), "{rec}");
    assert!(rec.contains("reconciler"), "{rec}");
    // Without a snapshot it comes back on its current rootfs.
    let bare = s.create(&[]);
    s.sh(&bare, "echo kept > /root/kept");
    std::process::Command::new("kill")
        .args(["-9", &init_pid(&s, &bare).to_string()])
        .status()
        .unwrap();
    wait_running(&s, &bare, 30);
    assert_eq!(s.sh(&bare, "cat /root/kept").1, "kept\n");
    assert!(s.space_ok(&["events", &bare]).contains("rootfs"));
    // Removing them still works and frees everything; the events outlive them.
    s.space_ok(&["rm", &id, &bare]);
    assert!(!s.data_dir().join("volume/sandboxes").join(&id).exists());
    let events: Value = serde_json::from_str(&s.space_ok(&["events", &id, "--json"])).unwrap();
    let actions: Vec<&str> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    for want in [
        "create",
        "exec",
        "snapshot",
        "recovered",
        "delete",
        "deleted",
    ] {
        assert!(actions.contains(&want), "{want} missing: {actions:?}");
    }
}

/// Every process in the test's cgroups (v1 hybrid or v2).
fn kill_cgroup_tree(parent: &str) {
    fn walk(dir: &std::path::Path) {
        // Frozen processes do not die until thawed (v1 freezer, v2 cgroup.freeze).
        let _ = std::fs::write(dir.join("freezer.state"), "THAWED");
        let _ = std::fs::write(dir.join("cgroup.freeze"), "0");
        if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
            for pid in procs.split_whitespace() {
                let _ = std::process::Command::new("kill")
                    .args(["-9", pid])
                    .status();
            }
        }
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    walk(&e.path());
                }
            }
        }
    }
    for root in [
        "/sys/fs/cgroup",
        "/sys/fs/cgroup/pids",
        "/sys/fs/cgroup/memory",
        "/sys/fs/cgroup/cpu",
        "/sys/fs/cgroup/freezer",
    ] {
        let dir = std::path::Path::new(root).join(parent);
        if dir.is_dir() {
            walk(&dir);
        }
    }
}

/// A host reboot, simulated: spaced and every sandbox process die, the volume's mount and
/// loop device and the run dir are gone.
fn simulate_reboot(s: &mut Spaced) {
    s.kill9();
    // A clean reboot flushes file systems; a power loss is not simulated here.
    let _ = std::process::Command::new("sync").status();
    kill_cgroup_tree(&s.cgroup_parent);
    std::thread::sleep(Duration::from_millis(300));
    let volume = s.data_dir().join("volume");
    let _ = std::process::Command::new("umount")
        .arg("-l")
        .arg(&volume)
        .status();
    let image = s.data_dir().join("space-btrfs.img");
    let out = std::process::Command::new("losetup")
        .arg("-j")
        .arg(&image)
        .output()
        .unwrap();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some(dev) = line.split(':').next() {
            let _ = std::process::Command::new("losetup")
                .args(["-d", dev])
                .status();
        }
    }
    s.reset_network_as_after_reboot();
    std::fs::remove_dir_all(s.run_dir()).unwrap();
}

#[test]
fn every_sandbox_comes_back_after_a_host_reboot() {
    let mut s = Spaced::start().unwrap();
    let snapped = s.create(&[]);
    s.sh(&snapped, "echo saved > /root/saved");
    s.space_ok(&["snapshot", &snapped]);
    let bare = s.create(&[]);
    s.sh(&bare, "echo kept > /root/kept && sync");
    let paused = s.create(&[]);
    s.space_ok(&["pause", &paused]);
    simulate_reboot(&mut s);
    let start = Instant::now();
    s.spawn().unwrap();
    for id in [&snapped, &bare, &paused] {
        wait_running(&s, id, 60);
    }
    eprintln!("all back {:?} after the restart", start.elapsed());
    assert_eq!(s.sh(&snapped, "cat /root/saved").1, "saved\n");
    assert_eq!(s.sh(&bare, "cat /root/kept").1, "kept\n");
    s.space_ok(&["rm", &snapped, &bare, &paused]);
}

/// Issue 14's "also found": a second spaced pointed at a run dir a live one holds is refused
/// before it touches anything, naming the holder; the first one's sandboxes keep running.
#[test]
fn a_second_spaced_on_a_held_run_dir_is_refused() {
    let s = Spaced::start().unwrap();
    let id = s.create(&[]);
    let other = tempfile::Builder::new()
        .prefix("space-it-second-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let out = std::process::Command::new(space_tests::bin_dir().join("spaced"))
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--data-dir")
        .arg(other.path())
        .arg("--run-dir")
        .arg(s.run_dir())
        .arg("--daemon-binary")
        .arg(space_tests::daemon_binary())
        .args([
            "--network",
            "off",
            "--microvm",
            "off",
            "--base-cache",
            "none",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("is in use by another space node")
            && stderr.contains(&format!("pid {}", s.pid())),
        "{stderr}"
    );
    // It made nothing in its own data dir, and the first spaced's sandbox is untouched.
    assert_eq!(std::fs::read_dir(other.path()).unwrap().count(), 0);
    assert_eq!(s.sh(&id, "echo alive").1, "alive\n");
    assert_eq!(state_of(&s, &id), "running");
}

/// A node whose volume holds microvm snapshots in the layout before decision 0038 (plain
/// files: `snapshots/<snap>/disk.ext4`, `vm/`) moves each into a read-only subvolume when it
/// starts; a rollback to such a checkpoint brings its memory back, as before.
#[test]
fn microvm_snapshots_of_the_old_layout_are_moved_into_subvolumes_at_start() {
    let mut s = Spaced::start_with(&["--warm-pool", "0:0"]).unwrap();
    let id = s.create(&["--runtime", "microvm", "--memory", "256"]);
    s.sh(&id, "echo at-checkpoint > /tmp/mem");
    let cp = s
        .space_ok(&["snapshot", &id, "--checkpoint"])
        .trim()
        .to_string();
    s.sh(&id, "echo later > /tmp/mem");
    s.stop().unwrap();
    // Back to the old layout: the files out of the subvolume, the subvolume gone.
    let dir = s
        .data_dir()
        .join(format!("volume/sandboxes/{id}/snapshots/{cp}"));
    let sh = |script: &str| {
        let st = std::process::Command::new("sh")
            .args(["-c", script])
            .current_dir(&dir)
            .status()
            .unwrap();
        assert!(st.success(), "{script}");
    };
    sh("cp -a --reflink=always rootfs/disk.ext4 rootfs/vm . && btrfs -q subvolume delete rootfs");
    assert!(dir.join("disk.ext4").is_file() && !dir.join("rootfs").exists());
    s.spawn().unwrap();
    assert!(dir.join("rootfs/disk.ext4").is_file(), "not upgraded");
    assert!(dir.join("rootfs/vm/state").is_file());
    assert!(!dir.join("disk.ext4").exists() && !dir.join("vm").exists());
    s.space_ok(&["rollback", &id, &cp]);
    assert_eq!(s.inspect(&id)["restored"], true);
    assert_eq!(s.sh(&id, "cat /tmp/mem").1, "at-checkpoint\n");
    s.space_ok(&["rm", &id]);
}
