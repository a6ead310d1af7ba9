//! The control plane and the node survive crashes and restarts: sandboxes outlive spaced, are
//! re-adopted, and the reconciler notices sandboxes whose init died.

use std::time::{Duration, Instant};

use serde_json::Value;
use space_tests::Spaced;

fn state_of(s: &Spaced, id: &str) -> String {
    let v: Value = serde_json::from_str(&s.space_ok(&["inspect", id])).unwrap();
    v["state"].as_str().unwrap_or("").to_string()
}

#[test]
fn kill9_and_graceful_restart_keep_sandboxes() {
    let mut s = Spaced::start().unwrap();
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

#[test]
fn reconciler_marks_sandbox_whose_init_died() {
    let s = Spaced::start().unwrap();
    let id = s.create(&[]);
    let info: Value = serde_json::from_str(&s.space_ok(&["inspect", &id])).unwrap();
    let init = info["init_pid"]
        .as_u64()
        .expect("inspect shows the init's host pid");
    // Kill the sandbox's init from the host, behind spaced's back.
    std::process::Command::new("kill")
        .args(["-9", &init.to_string()])
        .status()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let st = state_of(&s, &id);
        if st == "stopped" || st == "failed" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "state still {st} after init died"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = s.space(&["exec", &id, "--", "true"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("conflict"),
        "{out:?}"
    );
    // Removing it still works and frees everything.
    s.space_ok(&["rm", &id]);
    assert!(!s.data_dir().join("volume/sandboxes").join(&id).exists());
}
