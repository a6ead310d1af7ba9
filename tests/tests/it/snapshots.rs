//! Snapshots, rollback and fork end to end (CLI and REST) against a real spaced.

use reqwest::Method;
use serde_json::{Value, json};
use space_tests::{Spaced, on_each_runtime};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn out(s: &Spaced, id: &str, script: &str) -> String {
    let (code, out, err) = s.sh(id, script);
    assert_eq!(code, 0, "{script}: {err}");
    out
}

on_each_runtime! {
fn snapshot_change_rollback_and_tree(rt) {
    let s = Spaced::start_on(rt).unwrap();
    let id = s.create(&[]);
    out(
        &s,
        &id,
        "echo one > /root/a; mkdir -p /root/d; echo x > /root/d/f",
    );
    s.space_ok(&["exec", &id, "-d", "--", "sleep", "1000"]);
    let uid_before = s.inspect(&id)["uid_base"].clone();

    let snap1 = s
        .space_ok(&["snapshot", &id, "--label", "first"])
        .trim()
        .to_string();
    assert_eq!(snap1.len(), 20, "{snap1:?}");
    // The sandbox keeps running after the freeze/thaw.
    assert!(out(&s, &id, "ps").contains("sleep 1000"));

    out(
        &s,
        &id,
        "echo two > /root/a; echo new > /root/b; rm -r /root/d",
    );
    let snap2 = s.space_ok(&["snapshot", &id]).trim().to_string();

    let sb: Value = serde_json::from_str(&{
        s.space_ok(&["rollback", &id, &snap1]);
        s.space_ok(&["inspect", &id])
    })
    .unwrap();
    assert_eq!(sb["state"], "running");
    assert_eq!(sb["uid_base"], uid_before, "same uid range after rollback");
    assert_eq!(out(&s, &id, "cat /root/a /root/d/f"), "one\nx\n");
    let (code, _, _) = s.sh(&id, "test -e /root/b");
    assert_ne!(code, 0, "a file created after the snapshot is gone");
    // Processes started fresh: the background sleep is gone.
    assert!(!out(&s, &id, "ps").contains("sleep 1000"));

    // The sandbox stays writable; rolling forward to snap2 works too.
    out(&s, &id, "echo three > /root/a");
    s.space_ok(&["rollback", &id, &snap2]);
    assert_eq!(out(&s, &id, "cat /root/a /root/b"), "two\nnew\n");

    // Tree: snap2's parent is snap1; after rolling back to snap1 the next snapshot's parent
    // is snap1 again (a branch).
    s.space_ok(&["rollback", &id, &snap1]);
    let snap3 = s.space_ok(&["snapshot", &id]).trim().to_string();
    let list = s.snapshots(&id);
    let by_id = |sid: &str| list.iter().find(|x| x["id"] == sid).unwrap().clone();
    assert_eq!(list.len(), 3);
    assert!(by_id(&snap1).get("parent_id").is_none());
    assert_eq!(by_id(&snap1)["label"], "first");
    assert_eq!(by_id(&snap1)["kind"], "disk");
    assert_eq!(by_id(&snap2)["parent_id"], snap1.as_str());
    assert_eq!(by_id(&snap3)["parent_id"], snap1.as_str());
    assert!(by_id(&snap1)["size_bytes"].as_u64().unwrap() > 0);
    let tree = s.space_ok(&["snapshots", &id]);
    assert!(tree.lines().any(|l| l.starts_with(&snap1)), "{tree}");
    assert!(
        tree.lines().any(|l| l.starts_with(&format!("  {snap2}"))),
        "{tree}"
    );
    assert!(
        tree.lines().any(|l| l.starts_with(&format!("  {snap3}"))),
        "{tree}"
    );

    // Deleting snap1 re-links its children to its parent (none).
    s.space_ok(&["snapshot-rm", &id, &snap1]);
    let list = s.snapshots(&id);
    assert_eq!(list.len(), 2);
    assert!(list.iter().all(|x| x.get("parent_id").is_none()));
    // Rolling back to the deleted snapshot: 404.
    let (st, v) = s.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/rollback"),
        Some(json!({"snapshot": snap1})),
    );
    assert_eq!((st, v["error"]["code"].as_str()), (404, Some("not_found")));
    s.space_ok(&["rm", &id]);
}
}

#[test]
fn fork_isolation_identity_count_and_source_deletion() {
    let s = Spaced::start().unwrap();
    let id = s.create(&["--env", "K=v", "--memory", "256"]);
    out(&s, &id, "echo shared > /root/f");
    let snap = s.space_ok(&["snapshot", &id]).trim().to_string();
    let forks: Vec<String> = s
        .space_ok(&["fork", &id, "--snapshot", &snap, "--count", "3"])
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(forks.len(), 3, "{forks:?}");
    let parent_map = out(&s, &id, "cat /proc/self/uid_map");
    let mut mids = Vec::new();
    let mut maps = vec![parent_map];
    for f in &forks {
        assert_ne!(f, &id);
        let sb = s.inspect(f);
        assert_eq!(sb["state"], "running");
        assert_eq!(sb["memory_mib"], 256);
        assert_eq!(sb["env"]["K"], "v");
        assert_eq!(sb["hostname"], f.as_str());
        let o = out(
            &s,
            f,
            "cat /root/f; hostname; cat /etc/hostname /etc/machine-id; echo $K",
        );
        let lines: Vec<&str> = o.lines().collect();
        assert_eq!(lines[0], "shared");
        assert_eq!(lines[1], f.as_str(), "hostname is the fork's id");
        assert_eq!(lines[2], f.as_str());
        assert_eq!(lines[3].len(), 32, "machine-id {:?}", lines[3]);
        assert!(lines[3].bytes().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(lines[4], "v");
        mids.push(lines[3].to_string());
        maps.push(out(&s, f, "cat /proc/self/uid_map"));
    }
    mids.sort();
    mids.dedup();
    assert_eq!(mids.len(), 3, "distinct machine ids");
    let mut m2 = maps.clone();
    m2.sort();
    m2.dedup();
    assert_eq!(m2.len(), 4, "distinct uid ranges: {maps:?}");

    // Isolation: writes in a fork are invisible to the parent and to other forks, and back.
    out(&s, &forks[0], "echo mine > /root/f; echo only0 > /root/g");
    out(&s, &id, "echo parent > /root/p");
    assert_eq!(out(&s, &id, "cat /root/f"), "shared\n");
    assert_eq!(out(&s, &forks[1], "cat /root/f"), "shared\n");
    for (who, path) in [
        (&id, "/root/g"),
        (&forks[1], "/root/g"),
        (&forks[0], "/root/p"),
    ] {
        let (code, _, _) = s.sh(who, &format!("test -e {path}"));
        assert_ne!(code, 0, "{path} leaked into {who}");
    }

    // A fork's first snapshot descends from the snapshot it was forked from.
    let fsnap = s.space_ok(&["snapshot", &forks[0]]).trim().to_string();
    let list = s.snapshots(&forks[0]);
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["id"], fsnap.as_str());
    assert_eq!(list[0]["parent_id"], snap.as_str());

    // Fork without --snapshot snapshots the live state first.
    let live: Vec<String> = s
        .space_ok(&["fork", &id])
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(live.len(), 1);
    assert_eq!(out(&s, &live[0], "cat /root/p"), "parent\n");
    assert_eq!(s.snapshots(&id).len(), 2);

    // Deleting the source snapshot and then the source sandbox leaves the forks intact.
    s.space_ok(&["snapshot-rm", &id, &snap]);
    s.space_ok(&["rm", &id]);
    for f in &forks[1..] {
        assert_eq!(out(&s, f, "cat /root/f"), "shared\n");
        out(&s, f, "echo still-writable > /root/w; cat /root/w");
    }
    assert_eq!(out(&s, &forks[0], "cat /root/f /root/g"), "mine\nonly0\n");
    // The fork's snapshot lost its (deleted) parent link but still rolls back fine.
    let list = s.snapshots(&forks[0]);
    assert!(list[0].get("parent_id").is_none(), "{list:?}");
    out(&s, &forks[0], "rm /root/g");
    s.space_ok(&["rollback", &forks[0], &fsnap]);
    assert_eq!(out(&s, &forks[0], "cat /root/g"), "only0\n");
    for f in forks.iter().chain(&live) {
        s.space_ok(&["rm", f]);
    }
}

#[test]
fn bad_input() {
    let s = Spaced::start().unwrap();
    let a = s.create(&[]);
    let b = s.create(&[]);
    let snap_b = s.space_ok(&["snapshot", &b]).trim().to_string();
    let unknown = "zzzzzzzzzzzzzzzzzzzz";
    let expect = |r: (u16, Value), status: u16, code: &str| {
        assert_eq!(r.0, status, "{}", r.1);
        assert_eq!(r.1["error"]["code"], code, "{}", r.1);
    };

    // Rollback to another sandbox's snapshot: 400 that says so.
    let r = s.call(
        Method::POST,
        &format!("/v1/sandboxes/{a}/rollback"),
        Some(json!({"snapshot": snap_b})),
    );
    assert!(
        r.1["error"]["message"].as_str().unwrap().contains(&b),
        "{}",
        r.1
    );
    expect(r, 400, "invalid_argument");
    // Fork of another sandbox's snapshot too.
    let r = s.call(
        Method::POST,
        &format!("/v1/sandboxes/{a}/fork"),
        Some(json!({"snapshot": snap_b})),
    );
    expect(r, 400, "invalid_argument");
    // Unknown snapshot / sandbox.
    let r = s.call(
        Method::DELETE,
        &format!("/v1/sandboxes/{a}/snapshots/{unknown}"),
        None,
    );
    expect(r, 404, "not_found");
    let r = s.call(
        Method::DELETE,
        &format!("/v1/sandboxes/{a}/snapshots/{snap_b}"),
        None,
    );
    expect(r, 404, "not_found");
    let r = s.call(
        Method::POST,
        &format!("/v1/sandboxes/{unknown}/snapshots"),
        None,
    );
    expect(r, 404, "not_found");
    let r = s.call(
        Method::GET,
        &format!("/v1/sandboxes/{unknown}/snapshots"),
        None,
    );
    expect(r, 404, "not_found");
    let r = s.call(Method::POST, "/v1/sandboxes/NOPE/snapshots", None);
    expect(r, 400, "invalid_argument");
    // Bad bodies.
    let r = s.call(
        Method::POST,
        &format!("/v1/sandboxes/{b}/fork"),
        Some(json!({"count": 17})),
    );
    expect(r, 400, "invalid_argument");
    let r = s.call(
        Method::POST,
        &format!("/v1/sandboxes/{b}/snapshots"),
        Some(json!({"label": "x", "extra": 1})),
    );
    expect(r, 400, "invalid_argument");
    let r = s.call(
        Method::POST,
        &format!("/v1/sandboxes/{b}/rollback"),
        Some(json!({})),
    );
    expect(r, 400, "invalid_argument");
    // A snapshot through the API (no body) is 201 with the documented shape.
    let r = s.call(Method::POST, &format!("/v1/sandboxes/{b}/snapshots"), None);
    assert_eq!(r.0, 201, "{}", r.1);
    assert_eq!(r.1["parent_id"], snap_b.as_str());
    assert_eq!(r.1["sandbox_id"], b.as_str());
    // Fork of a deleted snapshot: 404; deleting it twice: 404.
    s.space_ok(&["snapshot-rm", &b, &snap_b]);
    let r = s.call(
        Method::POST,
        &format!("/v1/sandboxes/{b}/fork"),
        Some(json!({"snapshot": snap_b})),
    );
    expect(r, 404, "not_found");
    let r = s.call(
        Method::DELETE,
        &format!("/v1/sandboxes/{b}/snapshots/{snap_b}"),
        None,
    );
    expect(r, 404, "not_found");
    // The CLI reports errors with exit code 1.
    let o = s.space(&["rollback", &a, &snap_b]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not_found"));
    // Removing a sandbox removes its snapshots (the list of a removed sandbox is 404).
    s.space_ok(&["snapshot", &a]);
    s.space_ok(&["rm", &a, &b]);
    let r = s.call(Method::GET, &format!("/v1/sandboxes/{a}/snapshots"), None);
    expect(r, 404, "not_found");
    let left = s.user_sandbox_dirs();
    assert!(
        left.is_empty(),
        "sandbox dirs (with snapshots) are gone: {left:?}"
    );
}

/// Latency of snapshot, fork (to the first exec in the child) and rollback on a sandbox
/// holding ~1 GiB of files. A benchmark, not a timed test: run it against a release build
/// with `--ignored --nocapture` (figures in docs/decisions/0007-snapshots.md).
#[test]
#[ignore]
fn bench_snapshot_fork_rollback() {
    use std::time::{Duration, Instant};
    let s = Spaced::start().unwrap();
    let id = s.create(&["--memory", "1024"]);
    out(
        &s,
        &id,
        "mkdir -p /root/data; i=0; while [ $i -lt 1024 ]; do \
         dd if=/dev/urandom of=/root/data/f$i bs=1M count=1 2>/dev/null; i=$((i+1)); done; \
         du -sm /root/data",
    );
    let n = 30;
    let rt = rt();
    let (mut snap_t, mut fork_t, mut rb_t) = (Vec::new(), Vec::new(), Vec::new());
    let mut fork_api_t = Vec::new();
    let mut snaps = Vec::new();
    let mut forks = Vec::new();
    rt.block_on(async {
        let post = |path: String, body: Value| {
            let rb = s.req(Method::POST, &path).json(&body);
            async move {
                let r = rb.send().await.unwrap();
                let st = r.status().as_u16();
                let v: Value = r.json().await.unwrap_or(Value::Null);
                assert!(st < 300, "{path}: {st} {v}");
                v
            }
        };
        for _ in 0..n {
            let t = Instant::now();
            let v = post(format!("/v1/sandboxes/{id}/snapshots"), json!({})).await;
            snap_t.push(t.elapsed());
            snaps.push(v["id"].as_str().unwrap().to_string());
        }
        for snap in &snaps {
            let t = Instant::now();
            let v = post(
                format!("/v1/sandboxes/{id}/fork"),
                json!({"snapshot": snap}),
            )
            .await;
            let fid = v["sandboxes"][0]["id"].as_str().unwrap().to_string();
            fork_api_t.push(t.elapsed());
            let r = s
                .req(Method::POST, &format!("/v1/sandboxes/{fid}/exec"))
                .json(&json!({"cmd": ["true"]}))
                .send()
                .await
                .unwrap();
            let body = r.text().await.unwrap();
            fork_t.push(t.elapsed());
            assert!(body.contains("\"exit\""), "{body}");
            forks.push(fid);
            // Keep at most a few forks alive (memory).
            if forks.len() > 4 {
                let old = forks.remove(0);
                s.req(Method::DELETE, &format!("/v1/sandboxes/{old}"))
                    .send()
                    .await
                    .unwrap();
            }
        }
        for i in 0..n {
            let t = Instant::now();
            post(
                format!("/v1/sandboxes/{id}/rollback"),
                json!({"snapshot": snaps[i % snaps.len()]}),
            )
            .await;
            rb_t.push(t.elapsed());
        }
        let t = Instant::now();
        let (st, _) = (
            s.req(Method::GET, &format!("/v1/sandboxes/{id}/snapshots"))
                .send()
                .await
                .unwrap()
                .status(),
            (),
        );
        assert!(st.is_success());
        println!(
            "list with {n} sizes computed (first time): {:?}",
            t.elapsed()
        );
    });
    let show = |name: &str, v: &mut Vec<Duration>| {
        v.sort();
        println!(
            "{name}: p50 {:.1} ms  p90 {:.1} ms  max {:.1} ms",
            space_tests::percentile(v, 50.0).as_secs_f64() * 1e3,
            space_tests::percentile(v, 90.0).as_secs_f64() * 1e3,
            v.last().unwrap().as_secs_f64() * 1e3
        );
    };
    show("snapshot", &mut snap_t);
    show("fork (to first exec)", &mut fork_t);
    show("fork (API call only)", &mut fork_api_t);
    show("rollback", &mut rb_t);
}

/// The parent UUID of a btrfs subvolume (`btrfs subvolume show`), and its own UUID.
fn subvolume_uuids(path: &std::path::Path) -> (String, String) {
    let out = std::process::Command::new("btrfs")
        .args(["subvolume", "show"])
        .arg(path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(name))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    (field("UUID:"), field("Parent UUID:"))
}

#[test]
fn a_snapshot_becomes_a_template_with_no_copy() {
    let s = Spaced::start().unwrap();
    let id = s.create(&[]);
    out(&s, &id, "mkdir -p /work && echo configured > /work/state");
    let snap = s
        .space_ok(&["snapshot", &id, "--label", "env"])
        .trim()
        .to_string();
    assert_eq!(
        s.space_ok(&["template", "from-snapshot", "mine", &id, &snap]),
        "mine 1\n"
    );
    // No copy: the template's rootfs is a btrfs snapshot of the sandbox's snapshot.
    let vol = s.data_dir().join("volume");
    let (snap_uuid, _) =
        subvolume_uuids(&vol.join(format!("sandboxes/{id}/snapshots/{snap}/rootfs")));
    let (_, parent) = subvolume_uuids(&vol.join("templates/mine/1/rootfs"));
    assert_eq!(parent, snap_uuid);

    // Sandboxes of it start with the snapshot's files, and outlive the source.
    let child = s.create(&["--template", "mine"]);
    assert_eq!(out(&s, &child, "cat /work/state"), "configured\n");
    s.space_ok(&["rm", &id]);
    let again = s.create(&["--template", "mine"]);
    assert_eq!(out(&s, &again, "cat /work/state"), "configured\n");
    let ls = s.space_ok(&["template", "ls"]);
    assert!(ls.contains("mine"), "{ls}");

    // Bad input: each a clear error, no template made.
    let other = s.create(&[]);
    let other_snap = s.space_ok(&["snapshot", &other]).trim().to_string();
    let post = |name: &str, body: Value| {
        s.call(
            Method::POST,
            &format!("/v1/templates/{name}/from-snapshot"),
            Some(body),
        )
    };
    for (name, body, status, msg) in [
        (
            "mine",
            json!({"sandbox": id, "snapshot": snap}),
            404,
            "not found",
        ),
        (
            "mine",
            json!({"sandbox": "aaaaaaaaaaaaaaaaaaaa", "snapshot": other_snap}),
            404,
            "not found",
        ),
        (
            "mine",
            json!({"sandbox": other, "snapshot": "aaaaaaaaaaaaaaaaaaaa"}),
            404,
            "snapshot aaaaaaaaaaaaaaaaaaaa not found",
        ),
        (
            "mine",
            json!({"sandbox": child, "snapshot": other_snap}),
            400,
            "belongs to sandbox",
        ),
        (
            "Bad Name",
            json!({"sandbox": other, "snapshot": other_snap}),
            400,
            "invalid template name",
        ),
        ("mine", json!({"sandbox": other}), 400, "snapshot"),
        (
            "mine",
            json!({"sandbox": "../x", "snapshot": other_snap}),
            400,
            "invalid sandbox id",
        ),
        (
            "mine",
            json!({"sandbox": other, "snapshot": other_snap, "extra": 1}),
            400,
            "unknown field",
        ),
    ] {
        let (code, body) = post(name, body.clone());
        assert_eq!(code, status, "{name} {body}");
        assert!(body.to_string().contains(msg), "{msg}: {body}");
    }
    let list = s.space_ok(&["template", "ls", "--json"]);
    let v: Value = serde_json::from_str(&list).unwrap();
    let mine = v["templates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "mine")
        .unwrap()
        .clone();
    assert_eq!(mine["version"], 1, "a refused call made a version: {v}");
}
