//! Negative control: run outside any sandbox (as root, the way the tests run), the probe must
//! notice that isolation does NOT hold, and its report must be complete and well-formed.

use std::process::Command;

/// `space-probe --list`: every check's name and class.
fn listed() -> Vec<(String, String)> {
    let out = Command::new(env!("CARGO_BIN_EXE_space-probe"))
        .arg("--list")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let list: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    list.iter()
        .map(|v| {
            (
                v["name"].as_str().unwrap().to_owned(),
                v["class"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// The battery is at least 60 probes, and docs/THREAT_MODEL.md names every one of them.
#[test]
fn the_threat_model_lists_every_probe() {
    let list = listed();
    assert!(list.len() >= 60, "{} probes", list.len());
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/THREAT_MODEL.md"
    ))
    .unwrap();
    let missing: Vec<&str> = list
        .iter()
        .map(|(n, _)| n.as_str())
        .filter(|n| !doc.contains(&format!("`{n}`")))
        .collect();
    assert!(missing.is_empty(), "THREAT_MODEL.md lacks {missing:?}");
}

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
    let list = listed();
    for (key, class) in &list {
        let c = &obj[key.as_str()];
        assert!(
            c["ok"].is_boolean() && c["detail"].is_string() && c["class"] == class.as_str(),
            "{key}: {c}"
        );
    }
    assert_eq!(obj.len(), list.len());
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
        // The attempts a sandbox is refused, allowed here (harmlessly: see space_sys::probe).
        for k in [
            "io_uring_denied",
            "userfaultfd_denied",
            "name_to_handle_at_denied",
            "tiocsti_denied",
            "fsopen_denied",
            "open_tree_denied",
            "vsock_denied",
            "mknod_device_denied",
            "file_caps_denied",
            "clone3_enosys",
        ] {
            assert!(!ok(k), "{k} held on the host: {}", obj[k]);
        }
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
