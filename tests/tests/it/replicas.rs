//! Replicas and the loss of a node (issue 14, decision 0037): a sandbox created with
//! `--replicas 1` has each snapshot sent to a second node, incrementally; when its node is
//! killed with -9 and stays silent past `--node-lost-after`, it comes back on the replica's
//! node with its data up to its newest replicated snapshot, and its events say which one. A
//! sandbox without a replica is marked `lost`, not recreated empty. When the lost node comes
//! back, its stale copy of the restored sandbox is removed and the lost one is found again.

use std::time::{Duration, Instant};

use serde_json::Value;
use space_tests::{ClusterLab, Spaced, eventually};

use crate::cluster::{node_row, placed_on};

/// The combined harness: PostgreSQL, two control replicas and three nodes, nodes lost after
/// 5 s of silence.
fn three_nodes() -> ClusterLab {
    ClusterLab::start(3, &["--warm-pool", "0:0", "--node-lost-after", "5"], &[]).unwrap()
}

/// The sandbox's replica as `inspect` shows it (null until one holds a snapshot).
fn replica(s: &Spaced, id: &str) -> Value {
    s.inspect(id)["replica"].clone()
}

/// Waits until the replica of `id` holds snapshot `snap`; answers the replica.
fn wait_replicated(s: &Spaced, id: &str, snap: &str) -> Value {
    let mut last = Value::Null;
    let ok = eventually(Duration::from_secs(60), || {
        last = replica(s, id);
        last["snapshot_id"] == snap
    });
    assert!(
        ok,
        "snapshot {snap} of {id} was not replicated: {last}\n{}",
        s.space_ok(&["events", id])
    );
    last
}

/// On the combined harness, with a second fault: the replica the test drove is killed with
/// -9 together with the node, and the other replica alone marks the node lost, restores
/// the sandbox and finds the lost one again; once the first replica is back, both list the
/// same.
#[test]
fn a_lost_nodes_sandboxes_come_back_from_their_replicas() {
    let mut lab = three_nodes();
    let [own, lost_id, other_id] = [0, 1, 2].map(|i| lab.node_id(&lab.nodes[i]));
    let s = &lab.replicas[0];
    // Refused, nothing made: too many replicas, a malformed count.
    for (args, says) in [
        (vec!["create", "--replicas", "2"], "at most 1"),
        (vec!["create", "--replicas", "x"], "invalid"),
    ] {
        let out = s.space(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    let before: Value = serde_json::from_str(&s.space_ok(&["ls", "--json"])).unwrap();
    assert_eq!(before["sandboxes"].as_array().unwrap().len(), 0);

    // Both on the node that will die.
    s.space_ok(&["node", "drain", &own]);
    s.space_ok(&["node", "drain", &other_id]);
    let kept = s.create(&["--replicas", "1"]);
    let gone = s.create(&["--env", "K=gone"]);
    s.space_ok(&["node", "drain", &own, "--undo"]);
    s.space_ok(&["node", "drain", &other_id, "--undo"]);
    for id in [&kept, &gone] {
        assert_eq!(placed_on(s, id), lost_id);
    }
    assert_eq!(s.inspect(&kept)["replicas"], 1);
    assert!(replica(s, &kept).is_null(), "a replica before any snapshot");

    let (rc, sum, err) = s.sh(
        &kept,
        "head -c 8388608 /dev/urandom > /root/data && echo one > /root/f && sha256sum /root/data",
    );
    assert_eq!(rc, 0, "{err}");
    let first = s
        .space_ok(&["snapshot", &kept, "--label", "one"])
        .trim()
        .to_owned();
    let r = wait_replicated(s, &kept, &first);
    let keeper = r["node"].as_str().unwrap().to_owned();
    assert_ne!(keeper, lost_id, "the replica is on the sandbox's own node");
    assert!(r["last_bytes"].as_u64().unwrap() > 8 << 20, "{r}");

    // The second snapshot is sent incrementally: about the 4 MiB written, not the 12 MiB.
    let (rc, sum2, err) = s.sh(
        &kept,
        "head -c 4194304 /dev/urandom > /root/more && echo two > /root/f && sha256sum /root/more",
    );
    assert_eq!(rc, 0, "{err}");
    let second = s
        .space_ok(&["snapshot", &kept, "--label", "two"])
        .trim()
        .to_owned();
    let r = wait_replicated(s, &kept, &second);
    let inc = r["last_bytes"].as_u64().unwrap();
    assert!(
        (4 << 20..6 << 20).contains(&inc),
        "the second snapshot sent {inc} bytes for 4 MiB changed: {r}"
    );
    assert_eq!(r["node"], keeper.as_str());
    assert_eq!(r["snapshots"], 2);
    // After the newest replicated snapshot: lost with the node.
    assert_eq!(s.sh(&kept, "echo late > /root/after").0, 0);

    // The node dies and stays silent: unreachable, then lost. The replica this test drove
    // dies with it: the other one does the rest alone.
    lab.nodes[1].kill9_node();
    lab.replicas[0].kill9();
    let s = &lab.replicas[1];
    assert!(
        eventually(Duration::from_secs(90), || node_row(s, &lost_id)["state"]
            == "lost"),
        "the killed node was not marked lost:\n{}",
        s.space_ok(&["node", "ls"])
    );
    assert!(
        eventually(Duration::from_secs(60), || {
            let v = s.inspect(&kept);
            v["state"] == "running" && s.space(&["exec", &kept, "--", "true"]).status.success()
        }),
        "the replicated sandbox did not come back: {}\n{}",
        s.inspect(&kept),
        s.space_ok(&["events", &kept])
    );
    let events = s.space_ok(&["events", &kept]);
    let restored = events
        .lines()
        .find(|l| l.contains("restore") && l.contains(" ok"))
        .unwrap_or_else(|| panic!("no restore event:\n{events}"));
    assert!(
        restored.contains(&second) && restored.contains(&keeper) && restored.contains(&lost_id),
        "the restore event does not say where from: {restored}"
    );
    assert_eq!(s.sh(&kept, "sha256sum /root/data").1, sum);
    assert_eq!(s.sh(&kept, "sha256sum /root/more").1, sum2);
    assert_eq!(s.sh(&kept, "cat /root/f").1, "two\n");
    assert_ne!(
        s.sh(&kept, "test -e /root/after").0,
        0,
        "a file written after the last replicated snapshot came back"
    );
    // Its snapshot tree came along: rollback to the first one works on the new node.
    let snaps = s.space_ok(&["snapshots", &kept]);
    assert!(snaps.contains(&first) && snaps.contains(&second), "{snaps}");
    s.space_ok(&["rollback", &kept, &first]);
    assert_eq!(s.sh(&kept, "cat /root/f").1, "one\n");
    assert_eq!(s.sh(&kept, "sha256sum /root/data").1, sum);

    // Without a replica: lost, with a clear error, not recreated.
    let g = s.inspect(&gone);
    assert_eq!(g["state"], "lost", "{g}");
    assert!(
        g["error"]
            .as_str()
            .unwrap_or_default()
            .contains("no replica"),
        "{g}"
    );
    let out = s.space(&["exec", &gone, "--", "true"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("lost"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The restored sandbox gets a new replica on the node left (its old replica became it).
    let third = [own.as_str(), other_id.as_str()]
        .into_iter()
        .find(|n| *n != keeper)
        .unwrap()
        .to_owned();
    assert!(
        eventually(Duration::from_secs(60), || replica(s, &kept)["node"]
            == third.as_str()),
        "no new replica: {}",
        replica(s, &kept)
    );

    // The node comes back: its stale copy of the restored sandbox goes, the lost one is
    // found again with its processes.
    lab.nodes[1].spawn_node().unwrap();
    let doomed = &lab.nodes[1];
    assert!(
        // The stray's event is recorded once its removal returns, just after its dir goes.
        eventually(Duration::from_secs(60), || !doomed
            .user_sandbox_dirs()
            .contains(&kept)
            && s.inspect(&gone)["state"] == "running"
            && s.space_ok(&["events", &kept]).contains("stray")),
        "after the node came back: {:?}, {}\n{}",
        doomed.user_sandbox_dirs(),
        s.inspect(&gone),
        s.space_ok(&["events", &kept])
    );
    assert_eq!(s.sh(&gone, "echo $K").1, "gone\n");
    assert_eq!(s.sh(&kept, "cat /root/f").1, "one\n");
    let listed: Value = serde_json::from_str(&s.space_ok(&["ls", "--json"])).unwrap();
    assert_eq!(listed["sandboxes"].as_array().unwrap().len(), 2, "{listed}");
    // The first replica comes back and sees the same, from the same store and nodes.
    lab.replicas[0].spawn().unwrap();
    let s = &lab.replicas[0];
    let again: Value = serde_json::from_str(&s.space_ok(&["ls", "--json"])).unwrap();
    let ids = |v: &Value| {
        let mut ids: Vec<String> = v["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| format!("{} {}", x["id"], x["state"]))
            .collect();
        ids.sort();
        ids
    };
    assert_eq!(ids(&again), ids(&listed));
    for id in [&kept, &gone] {
        s.space_ok(&["rm", id]);
    }

    // A tenant's default: its creates that name no replicas (and whose template names
    // none) get one; a create that says 0 gets none.
    s.space_ok(&["tenant", "create", "team-r", "--replicas", "1"]);
    let key = s.space_ok(&["key", "create", "--tenant", "team-r"]);
    let as_tenant = |args: &[&str]| {
        let out = s
            .cli()
            .env("SPACE_API_KEY", key.trim())
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    };
    let defaulted = as_tenant(&["create"]);
    let explicit = as_tenant(&["create", "--replicas", "0"]);
    assert_eq!(s.inspect(&defaulted)["replicas"], 1);
    assert_eq!(s.inspect(&explicit)["replicas"].as_u64().unwrap_or(0), 0);
    s.space_ok(&["tenant", "set", "team-r"]);
    let unset = as_tenant(&["create"]);
    assert_eq!(s.inspect(&unset)["replicas"].as_u64().unwrap_or(0), 0);
    for id in [&defaulted, &explicit, &unset] {
        s.space_ok(&["rm", id]);
    }
}

/// Decision 0056: a move to the node that holds the sandbox's replica sends only what the
/// replica lacks, incremental against its newest snapshot; the moved sandbox keeps its data
/// and snapshot tree and gets a new replica elsewhere. A move to a node without one sends
/// everything, as before.
#[test]
fn a_move_to_its_replicas_node_sends_only_what_the_replica_lacks() {
    let lab = ClusterLab::start(3, &["--warm-pool", "0:0"], &[]).unwrap();
    let s = &lab.replicas[0];
    let nodes: Vec<String> = lab.nodes.iter().map(|n| lab.node_id(n)).collect();
    let id = s.create(&["--replicas", "1"]);
    let (rc, data, err) = s.sh(
        &id,
        "head -c 8388608 /dev/urandom > /root/data && sha256sum /root/data",
    );
    assert_eq!(rc, 0, "{err}");
    let snap = s.space_ok(&["snapshot", &id]).trim().to_owned();
    let keeper = wait_replicated(s, &id, &snap)["node"]
        .as_str()
        .unwrap()
        .to_owned();
    let (rc, late, err) = s.sh(
        &id,
        "head -c 1048576 /dev/urandom > /root/late && sha256sum /root/late",
    );
    assert_eq!(rc, 0, "{err}");

    let migrate = |to: &str| {
        let (status, m) = s.call(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/migrate"),
            Some(serde_json::json!({ "to": to })),
        );
        assert_eq!(status, 200, "{m}\n{}", s.space_ok(&["events", &id]));
        m
    };
    let m = migrate(&keeper);
    eprintln!(
        "to the replica's node: base {} bytes, final {} bytes, down {} ms",
        m["base_bytes"], m["final_bytes"], m["downtime_ms"]
    );
    assert_eq!(m["reused_snapshots"], serde_json::json!([snap]), "{m}");
    let base = m["base_bytes"].as_u64().unwrap();
    assert!(
        base < 4 << 20,
        "the move to the replica's node sent {base} bytes while it ran, for 1 MiB written \
         after the replicated snapshot: {m}"
    );
    assert_eq!(s.sh(&id, "sha256sum /root/data").1, data);
    assert_eq!(s.sh(&id, "sha256sum /root/late").1, late);
    assert!(s.space_ok(&["snapshots", &id]).contains(&snap));
    assert!(
        s.space_ok(&["events", &id])
            .contains("1 snapshots taken from its replica there"),
        "{}",
        s.space_ok(&["events", &id])
    );
    // It runs where its replica was: the replica goes to another node.
    let mut elsewhere = String::new();
    assert!(
        eventually(Duration::from_secs(60), || {
            let r = replica(s, &id);
            elsewhere = r["node"].as_str().unwrap_or_default().to_owned();
            !elsewhere.is_empty() && elsewhere != keeper && r["snapshot_id"] == snap.as_str()
        }),
        "no new replica: {}",
        replica(s, &id)
    );

    // To the node that holds nothing of it: everything is sent.
    let third = nodes
        .iter()
        .find(|n| **n != keeper && **n != elsewhere)
        .unwrap();
    let m = migrate(third);
    eprintln!(
        "to a node without a replica: base {} bytes, final {} bytes, down {} ms",
        m["base_bytes"], m["final_bytes"], m["downtime_ms"]
    );
    assert_eq!(m["reused_snapshots"], serde_json::json!([]), "{m}");
    assert!(m["base_bytes"].as_u64().unwrap() > 9 << 20, "{m}");
    assert_eq!(s.sh(&id, "sha256sum /root/late").1, late);
    // Its tree came along both times: a rollback to the snapshot works on the third node.
    s.space_ok(&["rollback", &id, &snap]);
    assert_eq!(s.sh(&id, "sha256sum /root/data").1, data);
    assert_ne!(s.sh(&id, "test -e /root/late").0, 0);
    s.space_ok(&["rm", &id]);
}

/// All-in-one has no other node to keep a replica on: refused, with the reason.
#[test]
fn replicas_need_a_cluster() {
    let s = Spaced::start_with(&["--warm-pool", "0:0"]).unwrap();
    let out = s.space(&["create", "--replicas", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("need a cluster"), "{err}");
    let out = s.space(&["template", "set", "minimal", "--replicas", "1"]);
    assert!(!out.status.success());
    let out = s.space(&["tenant", "create", "team-r", "--replicas", "1"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("need a cluster"));
    // Zero is fine anywhere.
    let id = s.create(&["--replicas", "0"]);
    s.space_ok(&["rm", &id]);
}

/// Replication figures for BENCHMARKS.md: bytes sent per snapshot against bytes changed,
/// and the lag from a snapshot to its replica holding it (the reconciler's pass included).
#[test]
#[ignore = "benchmark; prints figures for BENCHMARKS.md"]
fn bench_replication() {
    let n: usize = std::env::var("SPACE_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let lab = three_nodes();
    let s = &lab.replicas[0];
    let id = s.create(&["--replicas", "1"]);
    assert_eq!(
        s.sh(&id, "head -c 268435456 /dev/urandom > /root/base").0,
        0
    );
    let snap = s.space_ok(&["snapshot", &id]).trim().to_owned();
    let full = wait_replicated(s, &id, &snap)["last_bytes"]
        .as_u64()
        .unwrap();
    let mut ratios = Vec::new();
    let mut lags = Vec::new();
    for i in 0..n {
        let mib = 16;
        assert_eq!(
            s.sh(
                &id,
                &format!("head -c {} /dev/urandom > /root/f{i}", mib << 20)
            )
            .0,
            0
        );
        let t = Instant::now();
        let snap = s.space_ok(&["snapshot", &id]).trim().to_owned();
        let r = wait_replicated(s, &id, &snap);
        lags.push(t.elapsed());
        ratios.push(r["last_bytes"].as_u64().unwrap() as f64 / (mib << 20) as f64);
    }
    lags.sort();
    ratios.sort_by(f64::total_cmp);
    println!(
        "replication: first (256 MiB) {full} bytes; {n} snapshots of 16 MiB changed: sent/changed \
         p50 {:.3}x max {:.3}x; snapshot -> replicated p50 {:?} p90 {:?} p99 {:?}",
        space_tests::quantile(&ratios, 0.5),
        ratios.last().unwrap(),
        space_tests::percentile(&lags, 50.0),
        space_tests::percentile(&lags, 90.0),
        space_tests::percentile(&lags, 99.0),
    );
    s.space_ok(&["rm", &id]);
}
