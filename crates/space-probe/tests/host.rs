//! Negative control: run outside any sandbox (as root, the way the tests run), the probe must
//! notice that isolation does NOT hold, and its report must be complete and well-formed.

use std::process::Command;

const CHECKS: &[&str] = &[
    "pid1_is_daemon",
    "host_processes_invisible",
    "mount_denied",
    "umount_denied",
    "module_load_denied",
    "bpf_denied",
    "perf_event_open_denied",
    "keyctl_denied",
    "ptrace_pid1_denied",
    "unshare_userns_denied",
    "setns_denied",
    "uid_map",
    "caps",
    "bounding_set",
    "seccomp",
    "hostname",
    "proc_1_mem_denied",
    "reboot_denied",
    "kexec_denied",
    "host_root_invisible",
    "iopl_denied",
    "clock_settime_denied",
];

#[test]
fn unsandboxed_root_fails_the_probe() {
    let marker = tempfile_marker();
    let out = Command::new(env!("CARGO_BIN_EXE_space-probe"))
        .args([
            "--host-marker",
            &marker,
            "--expect-hostname",
            "not-this-host-xyz",
        ])
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&marker);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let obj = report.as_object().unwrap();
    for key in CHECKS {
        let c = &obj[*key];
        assert!(
            c["ok"].is_boolean() && c["detail"].is_string(),
            "{key}: {c}"
        );
    }
    assert_eq!(obj.len(), CHECKS.len());
    let ok = |k: &str| obj[k]["ok"].as_bool().unwrap();
    assert!(!ok("host_root_invisible"), "the marker exists here");
    assert!(!ok("hostname"), "hostname differs from the expected one");
    assert!(!ok("pid1_is_daemon"));
    if rustix::process::geteuid().is_root() {
        // Plain host root: full capabilities, identity uid map, no seccomp.
        assert!(!ok("caps"));
        assert!(!ok("bounding_set"));
        assert!(!ok("uid_map"));
        assert!(!ok("seccomp"));
        assert!(!ok("mount_denied"));
    }
}

#[test]
fn bad_usage_exits_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_space-probe"))
        .arg("--bogus")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

fn tempfile_marker() -> String {
    let p = std::env::temp_dir().join(format!("space-probe-marker-{}", std::process::id()));
    std::fs::write(&p, "x").unwrap();
    p.to_string_lossy().into_owned()
}
