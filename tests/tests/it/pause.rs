//! Pause/resume, auto-pause on idle and per-sandbox timeouts against a real spaced
//! (decision 0008).

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::Value;
use space_tests::{Spaced, on_each_runtime, percentile};

/// Runs the CLI expecting failure; returns its stderr.
fn space_err(s: &Spaced, args: &[&str]) -> String {
    let out = s.space(args);
    assert!(
        !out.status.success(),
        "space {args:?} unexpectedly succeeded"
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Polls `inspect` until `f` holds (or panics after `within`).
fn wait_for(s: &Spaced, id: &str, within: Duration, f: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let v = s.inspect(id);
        if f(&v) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "condition not reached within {within:?}: {v}\n{}",
            s.log_tail()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

async fn output_bytes(s: &Spaced, id: &str, pid: u32) -> u64 {
    let (code, v) = s
        .get_json(&format!("/v1/sandboxes/{id}/processes"))
        .await
        .unwrap();
    assert_eq!(code, 200, "{v}");
    let p = v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == pid)
        .unwrap_or_else(|| panic!("pid {pid} not in {v}"));
    assert_eq!(p["running"], true, "{p}");
    p["output_bytes"].as_u64().unwrap()
}

async fn post_status(s: &Spaced, path: &str) -> (u16, Value) {
    let r = s.req(Method::POST, path).send().await.unwrap();
    let code = r.status().as_u16();
    (code, r.json().await.unwrap_or(Value::Null))
}

on_each_runtime! {
async fn pause_freezes_resume_continues(rt) {
    let s = tokio::task::block_in_place(|| Spaced::start_on(rt).unwrap());
    let id = s.create(&[]);
    // A counter that prints a line every 50 ms and keeps its count in shell memory.
    let pid: u32 = s
        .space_ok(&[
            "exec",
            &id,
            "-d",
            "--",
            "sh",
            "-c",
            "i=0; while true; do i=$((i+1)); echo $i; echo $i > /tmp/c; sleep 0.05; done",
        ])
        .trim()
        .parse()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = output_bytes(&s, &id, pid).await;
    assert!(before > 0);

    let out = s.space_ok(&["pause", &id]);
    assert_eq!(out.trim(), format!("{id} paused"));
    let v = s.inspect(&id);
    assert_eq!(v["state"], "paused");
    assert!(v["paused_at"].is_string(), "{v}");

    // While paused: guest calls are refused at once with 409, not left hanging.
    let t = Instant::now();
    let err = space_err(&s, &["exec", &id, "--", "true"]);
    assert!(
        err.contains("(conflict)") && err.contains("paused"),
        "{err}"
    );
    let (code, v) = s
        .get_json(&format!("/v1/sandboxes/{id}/files/stat?path=/tmp/c"))
        .await
        .unwrap();
    assert_eq!(code, 409, "{v}");
    let (code, _) = s
        .get_json(&format!("/v1/sandboxes/{id}/processes"))
        .await
        .unwrap();
    assert_eq!(code, 409);
    // Refused at once, not after waiting on a frozen guest (bound generous for a loaded CI).
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    // Pausing twice conflicts; so does resuming a running sandbox; unknown ids are 404.
    assert!(space_err(&s, &["pause", &id]).contains("(conflict)"));
    let (code, v) = post_status(&s, &format!("/v1/sandboxes/{id}/pause")).await;
    assert_eq!((code, v["error"]["code"].as_str()), (409, Some("conflict")));
    let (code, _) = post_status(&s, "/v1/sandboxes/zzzzzzzzzzzzzzzzzzzz/pause").await;
    assert_eq!(code, 404);
    let (code, _) = post_status(&s, "/v1/sandboxes/zzzzzzzzzzzzzzzzzzzz/resume").await;
    assert_eq!(code, 404);

    // Frozen for 1.5 s: at 20 lines/s the counter would print ~30 lines (~90 bytes).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let out = s.space_ok(&["resume", &id]);
    assert_eq!(out.trim(), format!("{id} running"));
    let after = output_bytes(&s, &id, pid).await;
    assert!(
        after - before <= 24,
        "counter advanced while paused: {before} -> {after} bytes"
    );
    assert!(space_err(&s, &["resume", &id]).contains("(conflict)"));
    let (code, _) = post_status(&s, &format!("/v1/sandboxes/{id}/resume")).await;
    assert_eq!(code, 409);

    // Memory kept: the same process continues counting from where it was.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(output_bytes(&s, &id, pid).await > after);
    let (_, c, _) = s.sh(&id, "cat /tmp/c");
    let c: u64 = c.trim().parse().unwrap();
    assert!(
        c * 2 >= before,
        "count {c} restarted (had printed {before} bytes)"
    );
    let v = s.inspect(&id);
    assert_eq!(v["state"], "running");
    assert!(v.get("paused_at").is_none(), "{v}");

    // Latency of pause and resume over 50 cycles (HTTP round trip).
    let (mut p, mut r) = (Vec::new(), Vec::new());
    for _ in 0..50 {
        let t = Instant::now();
        let (code, _) = post_status(&s, &format!("/v1/sandboxes/{id}/pause")).await;
        p.push(t.elapsed());
        assert_eq!(code, 200);
        let t = Instant::now();
        let (code, _) = post_status(&s, &format!("/v1/sandboxes/{id}/resume")).await;
        r.push(t.elapsed());
        assert_eq!(code, 200);
    }
    p.sort();
    r.sort();
    println!(
        "pause p50 {:?} p90 {:?}; resume p50 {:?} p90 {:?}",
        percentile(&p, 50.0),
        percentile(&p, 90.0),
        percentile(&r, 50.0),
        percentile(&r, 90.0)
    );
    assert!(output_bytes(&s, &id, pid).await > after);

    // Removing a paused sandbox works and leaves nothing behind.
    // Its cgroups, as the kernel names them (a sandbox from the warm pool keeps the name it
    // was built under).
    let pid = s.inspect(&id)["init_pid"].as_u64().unwrap();
    s.space_ok(&["pause", &id]);
    let cgroups: Vec<String> = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, ctrls, path) = (f.next()?, f.next()?, f.next()?);
            // v2 (or hybrid's unified tree), or any v1 hierarchy (a VM's QEMU has memory,
            // cpu and pids; a namespace sandbox's processes the freezer too).
            let root = match ctrls {
                "" if std::path::Path::new("/sys/fs/cgroup/unified").is_dir() => {
                    "/sys/fs/cgroup/unified".to_string()
                }
                "" => "/sys/fs/cgroup".to_string(),
                c if std::path::Path::new(&format!("/sys/fs/cgroup/{c}")).is_dir() => {
                    format!("/sys/fs/cgroup/{c}")
                }
                _ => return None,
            };
            Some(format!("{root}{path}"))
        })
        .filter(|p| p.contains(&s.cgroup_parent))
        .collect();
    assert!(!cgroups.is_empty(), "no cgroup of the sandbox found for pid {pid}");
    for c in &cgroups {
        assert!(
            std::path::Path::new(c).exists(),
            "{c} not there while paused"
        );
    }
    let t = Instant::now();
    s.space_ok(&["rm", &id]);
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert_eq!(s.space(&["inspect", &id]).status.code(), Some(1));
    for c in &cgroups {
        assert!(!std::path::Path::new(c).exists(), "{c} left behind");
    }
}
}

#[test]
fn timeouts_pause_or_delete_and_are_never_reset() {
    let mut s = Spaced::start().unwrap();
    // A long timeout: unchanged by pause, resume and restarts of spaced.
    let a = s.create(&["--timeout", "3600"]);
    let v = s.inspect(&a);
    let t0 = v["timeout_at"].as_str().unwrap().to_string();
    assert_eq!(v["on_timeout"], "pause");
    s.space_ok(&["pause", &a]);
    assert_eq!(s.inspect(&a)["timeout_at"], t0.as_str());
    s.stop().unwrap();
    s.spawn().unwrap();
    let v = s.inspect(&a);
    assert_eq!(v["state"], "paused", "{v}");
    assert_eq!(v["timeout_at"], t0.as_str());
    s.kill9();
    s.spawn().unwrap();
    // Still paused after a crash (the node reads the freezer state), and resumable.
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(s.inspect(&a)["state"], "paused");
    s.space_ok(&["resume", &a]);
    assert_eq!(s.space_ok(&["exec", &a, "--", "echo", "ok"]), "ok\n");
    let v = s.inspect(&a);
    assert_eq!(
        (v["state"].as_str(), v["timeout_at"].as_str()),
        (Some("running"), Some(t0.as_str()))
    );

    // Only the timeout call changes it.
    let out = s.space_ok(&["timeout", &a, "7200"]);
    let t1 = s.inspect(&a)["timeout_at"].as_str().unwrap().to_string();
    assert!(out.contains(&t1) && t1 > t0, "{out} {t1} {t0}");
    s.space_ok(&["timeout", &a, "--clear"]);
    assert!(s.inspect(&a).get("timeout_at").is_none());

    // Expiry pauses (default) or deletes (on request); the reconciler runs every 2 s.
    let b = s.create(&["--timeout", "2"]);
    let c = s.create(&["--timeout", "2", "--on-timeout", "delete"]);
    let v = wait_for(&s, &b, Duration::from_secs(10), |v| v["state"] == "paused");
    assert!(
        v.get("timeout_at").is_none(),
        "a fired timeout is consumed: {v}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.space(&["inspect", &c]).status.success() {
        assert!(
            Instant::now() < deadline,
            "{c} not deleted\n{}",
            s.log_tail()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // A resumed sandbox is not paused again by the fired timeout.
    s.space_ok(&["resume", &b]);
    std::thread::sleep(Duration::from_millis(4500));
    assert_eq!(s.inspect(&b)["state"], "running");
}

#[test]
fn auto_pause_after_idle() {
    let s = Spaced::start().unwrap();
    let id = s.create(&["--auto-pause", "2"]);
    assert_eq!(s.inspect(&id)["auto_pause_secs"], 2);
    // An open exec stream is activity however long it lasts.
    assert_eq!(
        s.space_ok(&["exec", &id, "--", "sh", "-c", "sleep 5; echo done"]),
        "done\n"
    );
    assert_eq!(s.inspect(&id)["state"], "running");
    // Then idle: paused within the period plus a reconcile interval or two.
    let t = Instant::now();
    wait_for(&s, &id, Duration::from_secs(10), |v| v["state"] == "paused");
    assert!(
        t.elapsed() >= Duration::from_millis(1500),
        "{:?}",
        t.elapsed()
    );
    s.space_ok(&["resume", &id]);
    let v = s.inspect(&id);
    assert_eq!(
        (v["state"].as_str(), v["auto_pause_secs"].as_u64()),
        (Some("running"), Some(2))
    );
    // Calls keep it awake.
    for _ in 0..8 {
        s.space_ok(&["exec", &id, "--", "true"]);
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(s.inspect(&id)["state"], "running");
    wait_for(&s, &id, Duration::from_secs(10), |v| v["state"] == "paused");
    // Bad input.
    assert!(space_err(&s, &["create", "--auto-pause", "0"]).contains("invalid_argument"));
}

on_each_runtime! {
fn a_filesystem_only_pause_stops_everything_and_resume_starts_cold(rt) {
    let s = Spaced::start_on(rt).unwrap();
    let id = s.create(&[]);
    // /tmp is a tmpfs, which a stop empties as a reboot would: the file goes on the rootfs.
    s.space_ok(&["exec", &id, "--", "sh", "-c", "mkdir -p /data && echo kept > /data/f"]);
    let pid = s.space_ok(&["exec", &id, "-d", "--", "sleep", "300"]);
    let out = s.space_ok(&["pause", &id, "--filesystem-only"]);
    assert_eq!(out.trim(), format!("{id} stopped"));
    let v = s.inspect(&id);
    assert_eq!(v["state"], "stopped", "{v}");
    assert!(v.get("init_pid").is_none_or(Value::is_null), "{v}");

    // Stopped: guest calls say how to go on; a second pause of either kind conflicts.
    let err = space_err(&s, &["exec", &id, "--", "true"]);
    assert!(err.contains("stopped; resume starts it again"), "{err}");
    for body in [None, Some(serde_json::json!({"memory": false}))] {
        let (code, v) = s.call(Method::POST, &format!("/v1/sandboxes/{id}/pause"), body);
        assert_eq!(code, 409, "{v}");
    }
    let (code, v) = s.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/pause"),
        Some(serde_json::json!({"memory": "no"})),
    );
    assert_eq!((code, v["error"]["code"].as_str()), (400, Some("invalid_argument")), "{v}");

    // Resume starts it again on its files; the old processes are gone.
    let out = s.space_ok(&["resume", &id]);
    assert_eq!(out.trim(), format!("{id} running"));
    assert_eq!(s.space_ok(&["exec", &id, "--", "cat", "/data/f"]), "kept\n");
    let ps = s.space_ok(&["ps", &id]);
    assert!(!ps.contains("sleep"), "pid {} survived the stop: {ps}", pid.trim());
    let events = s.space_ok(&["events", &id]);
    assert!(events.contains("stopped") && events.contains("running"), "{events}");

    // A paused (frozen) sandbox is not stopped behind its back.
    s.space_ok(&["pause", &id]);
    let (code, v) = s.call(
        Method::POST,
        &format!("/v1/sandboxes/{id}/pause"),
        Some(serde_json::json!({"memory": false})),
    );
    assert_eq!(code, 409, "{v}");
    s.space_ok(&["resume", &id]);
    s.space_ok(&["rm", &id]);
}
}

/// `--on-timeout stop`: the deadline stops the sandbox (a filesystem-only pause) once; resume
/// starts it again with its files.
#[test]
fn a_timeout_can_stop_a_sandbox_keeping_its_files() {
    let s = Spaced::start().unwrap();
    let id = s.create(&["--timeout", "2", "--on-timeout", "stop"]);
    s.space_ok(&[
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "mkdir -p /data && echo kept > /data/f",
    ]);
    let v = wait_for(&s, &id, Duration::from_secs(30), |v| {
        v["state"] == "stopped"
    });
    assert!(v.get("timeout_at").is_none_or(Value::is_null), "{v}");
    s.space_ok(&["resume", &id]);
    assert_eq!(s.space_ok(&["exec", &id, "--", "cat", "/data/f"]), "kept\n");
    assert!(space_err(&s, &["create", "--on-timeout", "halt"]).contains("stop"));
}
