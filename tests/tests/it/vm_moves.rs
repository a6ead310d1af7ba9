//! A running microvm moves between nodes with its memory (issue 14, decision 0038): its
//! processes go on where they were, its files arrive byte for byte, and its snapshots and
//! memory checkpoints come along (a rollback to a checkpoint works on the new node). A
//! microvm's snapshots are replicated as a namespace sandbox's are.

use std::time::Duration;

use serde_json::Value;
use space_tests::{Spaced, eventually};

use crate::cluster::{node_id_of, placed_on, wait_reported};

fn out(s: &Spaced, id: &str, script: &str) -> String {
    let (rc, stdout, stderr) = s.sh(id, script);
    assert_eq!(rc, 0, "{script}: {stderr}");
    stdout.trim().to_owned()
}

#[test]
fn a_running_microvm_moves_with_its_memory_and_snapshots() {
    let s = Spaced::start_joined(&[], &["--warm-pool", "0:0"]).unwrap();
    let other = s.join_node(&[]).unwrap();
    let (a, b) = (node_id_of(&s), node_id_of(&other));
    wait_reported(&s, &a);
    wait_reported(&s, &b);
    let sandboxes = |node: &Spaced| node.data_dir().join("volume/sandboxes");
    let id = s.create(&["--runtime", "microvm", "--memory", "256", "--replicas", "1"]);
    let home = placed_on(&s, &id);
    let (from, to) = if home == a {
        (&s, &other)
    } else {
        (&other, &s)
    };

    // Files on its disk, and state that lives only in its memory: /tmp (a tmpfs) and a
    // process.
    let sum = out(
        &s,
        &id,
        "head -c 8388608 /dev/urandom > /root/data && sha256sum /root/data",
    );
    out(&s, &id, "echo at-checkpoint > /tmp/mem");
    let pid = s
        .space_ok(&[
            "exec",
            "-d",
            &id,
            "--",
            "sh",
            "-c",
            "while :; do sleep 1; done",
        ])
        .trim()
        .to_string();
    let cp = s
        .space_ok(&["snapshot", &id, "--checkpoint"])
        .trim()
        .to_string();
    // The checkpoint (disk and memory) reaches the replica's node.
    let ok = eventually(Duration::from_secs(90), || {
        s.inspect(&id)["replica"]["snapshot_id"] == cp.as_str()
    });
    assert!(ok, "not replicated: {}", s.space_ok(&["events", &id]));
    out(&s, &id, "echo moved > /tmp/mem; echo later > /root/after");
    let boot = out(&s, &id, "cat /proc/sys/kernel/random/boot_id");

    let m: Value = serde_json::from_str(&s.space_ok(&["migrate", &id, "--json"])).unwrap();
    assert_eq!(m["from"], home.as_str(), "{m}");
    assert_ne!(m["to"], home.as_str(), "{m}");
    assert_eq!(m["sandbox"]["state"], "running", "{m}");
    assert_eq!(m["processes_restarted"], false, "{m}");
    assert!(m["downtime_ms"].as_u64().unwrap() > 0, "{m}");
    eprintln!(
        "microvm move: {} ms, down {} ms, {} + {} bytes",
        m["total_ms"], m["downtime_ms"], m["base_bytes"], m["final_bytes"]
    );
    assert!(sandboxes(to).join(&id).is_dir());
    assert!(!sandboxes(from).join(&id).exists(), "the old copy stayed");
    assert_eq!(s.inspect(&id)["restored"], true);
    // The same running guest: its boot, its memory, its process; its files byte for byte.
    assert_eq!(out(&s, &id, "cat /proc/sys/kernel/random/boot_id"), boot);
    assert_eq!(out(&s, &id, "cat /tmp/mem /root/after"), "moved\nlater");
    assert_eq!(out(&s, &id, "sha256sum /root/data"), sum);
    let ps = s.space_ok(&["ps", &id]);
    assert!(ps.contains(&pid), "the process did not move with it: {ps}");
    let events = s.space_ok(&["events", &id]);
    assert!(events.contains("memory came with it"), "{events}");

    // Its checkpoint came too: a rollback on the new node brings back that memory.
    s.space_ok(&["rollback", &id, &cp]);
    assert_eq!(s.inspect(&id)["restored"], true);
    assert_eq!(out(&s, &id, "cat /tmp/mem"), "at-checkpoint");
    assert_ne!(
        s.sh(&id, "test -e /root/after").0,
        0,
        "rollback kept a later file"
    );
    assert_eq!(out(&s, &id, "sha256sum /root/data"), sum);

    // Stopped, it moves back without memory, and boots there with its files.
    s.space_ok(&["pause", &id, "--filesystem-only"]);
    let m: Value = serde_json::from_str(&s.space_ok(&["migrate", &id, "--json"])).unwrap();
    assert_eq!(m["to"], home.as_str(), "{m}");
    assert_eq!(m["sandbox"]["state"], "stopped", "{m}");
    s.space_ok(&["resume", &id]);
    assert_eq!(out(&s, &id, "sha256sum /root/data"), sum);
    assert!(sandboxes(from).join(&id).is_dir());
    s.space_ok(&["rm", &id]);
    assert!(eventually(Duration::from_secs(30), || !sandboxes(from)
        .join(&id)
        .exists()));
}

/// `SPACE_BENCH_N` (default 10) moves of a running microvm (256 MiB of RAM, a process, 64 MiB
/// written on its disk) back and forth: downtime and what each step sent (the final step
/// carries the VM's memory).
#[test]
#[ignore = "benchmark: run with --ignored --nocapture"]
fn bench_vm_migration() {
    let runs: usize = std::env::var("SPACE_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let s = Spaced::start_joined(&["--network", "off"], &["--warm-pool", "0:0"]).unwrap();
    let other = s.join_node(&["--network", "off"]).unwrap();
    wait_reported(&s, &node_id_of(&s));
    wait_reported(&s, &node_id_of(&other));
    let id = s.create(&["--runtime", "microvm", "--memory", "256"]);
    out(
        &s,
        &id,
        "head -c 67108864 /dev/urandom > /root/data && sync",
    );
    let pid = s
        .space_ok(&[
            "exec",
            "-d",
            &id,
            "--",
            "sh",
            "-c",
            "while :; do sleep 1; done",
        ])
        .trim()
        .to_string();
    let mut rows: Vec<[f64; 3]> = Vec::new();
    for i in 0..runs {
        let m: Value = serde_json::from_str(&s.space_ok(&["migrate", &id, "--json"])).unwrap();
        assert_eq!(m["processes_restarted"], false, "{m}");
        let row = ["downtime_ms", "base_bytes", "final_bytes"].map(|k| m[k].as_f64().unwrap());
        eprintln!(
            "move {i}: down {} ms, base {} B, final {} B",
            row[0], row[1], row[2]
        );
        rows.push(row);
    }
    assert!(s.space_ok(&["ps", &id]).contains(&pid));
    let pct = |k: usize, p: f64| {
        let mut v: Vec<f64> = rows.iter().map(|r| r[k]).collect();
        v.sort_by(f64::total_cmp);
        v[((v.len() as f64 - 1.0) * p).round() as usize]
    };
    let mib = |b: f64| b / f64::from(1u32 << 20);
    println!(
        "running microvm downtime: p50 {:.0} ms, p90 {:.0} ms, p99 {:.0} ms ({runs} moves); \
         sent while running p50 {:.1} MiB, while paused p50 {:.1} MiB",
        pct(0, 0.5),
        pct(0, 0.9),
        pct(0, 0.99),
        mib(pct(1, 0.5)),
        mib(pct(2, 0.5))
    );
}
