//! Checkpoints of the namespace runtime end to end (CLI and REST) against a real spaced:
//! disk + spec + the running processes, restarted from scratch after a rollback.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};
use space_tests::Spaced;

const TICKER: &str = "while true; do date +%s%N >> /root/ticks; sleep 0.1; done";

/// The running processes tagged "ticker".
fn tickers(s: &Spaced, id: &str) -> Vec<Value> {
    let (code, v) = s.call(Method::GET, &format!("/v1/sandboxes/{id}/processes"), None);
    assert_eq!(code, 200, "{v}");
    v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["running"] == true && p["tag"] == "ticker")
        .cloned()
        .collect()
}

fn ticks(s: &Spaced, id: &str) -> usize {
    let (code, out, err) = s.sh(id, "cat /root/ticks 2>/dev/null | wc -l");
    assert_eq!(code, 0, "{err}");
    out.trim().parse().unwrap()
}

/// Waits (up to 5 s) until the tick count exceeds `than`.
fn ticks_grow(s: &Spaced, id: &str, than: usize) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if ticks(s, id) > than {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

#[test]
fn checkpoint_rollback_restarts_processes_and_disk_rollback_does_not() {
    let s = Spaced::start().unwrap();
    let id = s.create(&[]);
    let pid = s
        .space_ok(&[
            "exec", "-d", "--tag", "ticker", &id, "--", "sh", "-c", TICKER,
        ])
        .trim()
        .to_string();
    assert!(ticks_grow(&s, &id, 0), "the ticker never ticked");

    let cp = s
        .space_ok(&["snapshot", &id, "--checkpoint", "--label", "cp"])
        .trim()
        .to_string();
    let disk = s.space_ok(&["snapshot", &id]).trim().to_string();
    let list = s.snapshots(&id);
    let by_id = |x: &str| list.iter().find(|v| v["id"] == x).unwrap().clone();
    let c = by_id(&cp);
    assert_eq!(c["kind"], "checkpoint", "{c}");
    assert_eq!(c["memory"], false, "{c}");
    let procs = c["processes"].as_array().unwrap();
    assert_eq!(procs.len(), 1, "{c}");
    assert_eq!(procs[0]["cmd"], json!(["sh", "-c", TICKER]));
    assert_eq!(procs[0]["tag"], "ticker");
    assert!(procs[0].get("env").is_none());
    assert_eq!(by_id(&disk)["kind"], "disk");
    assert!(by_id(&disk).get("processes").is_none());
    let tree = s.space_ok(&["snapshots", &id]);
    assert!(
        tree.lines()
            .any(|l| l.contains(&cp) && l.contains("checkpoint(1)")),
        "{tree}"
    );

    // Kill it: nothing ticks any more.
    s.space_ok(&["kill", &id, &pid]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !tickers(&s, &id).is_empty() {
        assert!(Instant::now() < deadline, "the ticker did not die");
        std::thread::sleep(Duration::from_millis(50));
    }

    // A disk snapshot's rollback restarts nothing.
    s.space_ok(&["rollback", &id, &disk]);
    assert!(tickers(&s, &id).is_empty());
    let n = ticks(&s, &id);
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(ticks(&s, &id), n, "something ticks after a disk rollback");

    // The checkpoint's rollback starts the ticker again, fresh.
    s.space_ok(&["rollback", &id, &cp]);
    let running = tickers(&s, &id);
    assert_eq!(running.len(), 1, "{running:?}");
    assert_eq!(running[0]["cmd"], json!(["sh", "-c", TICKER]));
    let ps = s.space_ok(&["ps", &id]);
    assert!(
        ps.lines()
            .any(|l| l.contains("running") && l.contains("ticker") && l.contains("sh -c")),
        "{ps}"
    );
    let n = ticks(&s, &id);
    assert!(ticks_grow(&s, &id, n), "the restarted ticker does not tick");

    // One event per restart, naming argv[0] only.
    let (code, ev) = s.call(Method::GET, &format!("/v1/sandboxes/{id}/events"), None);
    assert_eq!(code, 200);
    let restarted: Vec<&Value> = ev["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "process_restarted")
        .collect();
    assert_eq!(restarted.len(), 1, "{ev}");
    assert_eq!(restarted[0]["result"], "ok");
    assert_eq!(restarted[0]["detail"], "sh");

    // Bad input.
    let (code, v) = s.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/snapshots"),
        Some(json!({"kind": "memory"})),
    );
    assert_eq!(code, 400, "{v}");
    s.space_ok(&["rm", &id]);
}
