//! Snapshot policy end to end (decision 0010): periodic snapshots only while files change,
//! one after every exec, retention, visibility in `space inspect`, bad input.

use std::time::Duration;

use reqwest::Method;
use serde_json::{Value, json};
use space_tests::{Spaced, eventually};

fn autos(s: &Spaced, id: &str) -> Vec<Value> {
    s.snapshots(id)
        .into_iter()
        .filter(|v| v["auto"] == true)
        .collect()
}

#[test]
fn periodic_snapshots_only_while_files_change() {
    let s = Spaced::start().unwrap();
    let id = s.create(&["--snapshot-every", "1"]);
    let p = &s.inspect(&id)["snapshot_policy"];
    assert_eq!(p["every_secs"], 1, "{p}");
    // The first check finds no snapshot yet: one is taken.
    assert!(
        eventually(Duration::from_secs(20), || !autos(&s, &id).is_empty()),
        "no first automatic snapshot"
    );
    // Settle: let a check see the state as it is now.
    std::thread::sleep(Duration::from_secs(3));
    let before = autos(&s, &id).len();
    // No writes: no new snapshot.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(autos(&s, &id).len(), before, "snapshots without changes");
    // Writes: at least one new snapshot within a few periods.
    let (code, _, err) = s.sh(&id, "echo hi > /root/new-file");
    assert_eq!(code, 0, "{err}");
    assert!(
        eventually(Duration::from_secs(20), || autos(&s, &id).len() > before),
        "no snapshot after a change"
    );
    let list = autos(&s, &id);
    assert!(list.iter().all(|v| v.get("label").is_none()), "{list:?}");
    // Paused sandboxes are skipped.
    s.space_ok(&["pause", &id]);
    let n = autos(&s, &id).len();
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(autos(&s, &id).len(), n);
    s.space_ok(&["resume", &id]);
    // Clearing the period stops it.
    s.space_ok(&["snapshot-policy", &id, "--no-every"]);
    assert!(s.inspect(&id).get("snapshot_policy").is_none());
    let n = autos(&s, &id).len();
    let (code, _, _) = s.sh(&id, "echo more > /root/more");
    assert_eq!(code, 0);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(autos(&s, &id).len(), n);
}

#[test]
fn after_exec_and_retention_keep_last_with_labelled_kept() {
    let s = Spaced::start().unwrap();
    let id = s.create(&["--snapshot-after-exec", "--keep-last", "2"]);
    let p = s.inspect(&id)["snapshot_policy"].clone();
    assert_eq!(p, json!({"after_exec": true, "keep_last": 2}));
    let labelled = s
        .space_ok(&["snapshot", &id, "--label", "mine"])
        .trim()
        .to_string();
    // One automatic snapshot per exec (asynchronous: wait for each).
    for i in 1..=2 {
        let (code, _, err) = s.sh(&id, &format!("echo {i} > /root/f{i}"));
        assert_eq!(code, 0, "{err}");
        assert!(
            eventually(Duration::from_secs(20), || autos(&s, &id).len() == i),
            "exec {i}: {:?}",
            s.snapshots(&id)
        );
    }
    // More execs: retention keeps exactly the newest two automatic ones (each exec's own
    // snapshot is the newest before the next exec starts).
    let mut last = autos(&s, &id).last().map(|v| v["id"].clone());
    for i in 3..=5 {
        let (code, _, _) = s.sh(&id, &format!("echo {i} > /root/f{i}"));
        assert_eq!(code, 0);
        let prev = last.clone();
        assert!(
            eventually(Duration::from_secs(20), || {
                let a = autos(&s, &id);
                let newest = a.last().map(|v| v["id"].clone());
                let ok = a.len() == 2 && newest != prev;
                if ok {
                    last = newest;
                }
                ok
            }),
            "exec {i}: {:?}",
            s.snapshots(&id)
        );
    }
    let all = s.snapshots(&id);
    assert!(
        all.iter().any(|v| v["id"] == labelled.as_str()),
        "labelled snapshot kept: {all:?}"
    );
    assert_eq!(all.len(), 3, "{all:?}");
    // The newest automatic snapshot holds the last exec's file: roll back to it.
    let newest = autos(&s, &id).last().unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    s.space_ok(&["rollback", &id, &newest]);
    let (code, out, _) = s.sh(&id, "cat /root/f5");
    assert_eq!((code, out.as_str()), (0, "5\n"));
}

#[test]
fn policy_changes_and_bad_input() {
    let s = Spaced::start().unwrap();
    let id = s.create(&[]);
    assert!(s.inspect(&id).get("snapshot_policy").is_none());
    let path = format!("/v1/sandboxes/{id}/snapshot-policy");
    let (st, sb) = s.call(
        Method::PUT,
        &path,
        Some(json!({"every_secs": 60, "keep_last": 3, "keep_labelled": false})),
    );
    assert_eq!(st, 200, "{sb}");
    assert_eq!(
        sb["snapshot_policy"],
        json!({"every_secs": 60, "keep_last": 3, "keep_labelled": false})
    );
    // The CLI changes only what it is told.
    let out = s.space_ok(&["snapshot-policy", &id, "--after-exec", "--keep-labelled"]);
    let p: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        p,
        json!({"every_secs": 60, "after_exec": true, "keep_last": 3})
    );
    assert_eq!(s.inspect(&id)["snapshot_policy"], p);
    for bad in [
        json!({"keep_last": 0}),
        json!({"keep_last": 1001}),
        json!({"every_secs": 0}),
        json!({"every_secs": 1, "bogus": true}),
        json!({"after_exec": "yes"}),
    ] {
        let (st, body) = s.call(Method::PUT, &path, Some(bad.clone()));
        assert_eq!(st, 400, "{bad}: {body}");
    }
    let (st, _) = s.call(
        Method::PUT,
        &format!("/v1/sandboxes/{}/snapshot-policy", "z".repeat(20)),
        Some(json!({"every_secs": 5})),
    );
    assert_eq!(st, 404);
    let (st, body) = s.call(
        Method::POST,
        "/v1/sandboxes",
        Some(json!({"snapshot_policy": {"keep_last": 0}})),
    );
    assert_eq!(st, 400, "{body}");
    // An empty policy removes it.
    let (st, sb) = s.call(Method::PUT, &path, Some(json!({})));
    assert_eq!(st, 200);
    assert!(sb.get("snapshot_policy").is_none(), "{sb}");
}
