//! Disk limits per sandbox (decision 0043) against a real spaced: a write past the limit is
//! "Disk quota exceeded" inside, in that sandbox only; what a snapshot keeps stays charged;
//! forks get their own limit; a spaced with `--disk-quotas off` refuses a limit by name.

use std::time::Duration;

use reqwest::Method;
use serde_json::json;
use space_tests::{Spaced, eventually};

/// Writes `mib` MiB to `path` inside, made durable; (exit code, dd's messages).
fn write(s: &Spaced, id: &str, path: &str, mib: u32) -> (i32, String) {
    let (code, _, err) = s.sh(
        id,
        &format!("dd if=/dev/zero of={path} bs=1M count={mib} conv=fsync status=none"),
    );
    (code, err)
}

/// Its charged bytes once btrfs has committed: the charge is counted at a transaction commit,
/// and an fsync alone goes to the log tree, so the node's volume is synced first.
fn disk_bytes(s: &Spaced, id: &str) -> u64 {
    let vol = s.data_dir().join("volume");
    let _ = std::process::Command::new("btrfs")
        .args(["filesystem", "sync"])
        .arg(&vol)
        .status();
    s.inspect(id)["disk_bytes"].as_u64().unwrap_or(0)
}

#[test]
fn a_full_disk_limit_is_edquot_inside_and_snapshots_count() {
    let s = Spaced::start().unwrap();
    let a = s.create(&["--disk", "64"]);
    let b = s.create(&[]);
    let sb = s.inspect(&a);
    assert_eq!(sb["disk_mib"], 64, "{sb}");
    assert!(s.inspect(&b).get("disk_mib").is_none());

    assert_eq!(write(&s, &a, "/root/f", 40), (0, String::new()));
    assert!(disk_bytes(&s, &a) >= 40 << 20, "{}", s.inspect(&a));
    let snap = s.space_ok(&["snapshot", &a]).trim().to_string();
    // The snapshot keeps f: removing it inside frees nothing of the limit.
    assert_eq!(s.sh(&a, "rm /root/f && sync").0, 0);
    let (code, err) = write(&s, &a, "/root/g", 40);
    assert_ne!(code, 0, "a write past the limit succeeded");
    assert!(err.contains("Disk quota exceeded"), "{err}");
    // The sandbox still works, and can free what it wrote.
    assert_eq!(s.sh(&a, "rm -f /root/g; echo ok").1, "ok\n");

    // The neighbour has no limit: it writes more than a's whole limit.
    assert_eq!(write(&s, &b, "/root/big", 96), (0, String::new()));

    // Deleting the snapshot frees f's blocks (btrfs frees them in the background).
    s.space_ok(&["snapshot-rm", &a, &snap]);
    let vol = s.data_dir().join("volume");
    assert!(
        eventually(Duration::from_secs(60), || {
            // Waits for the cleaner to drop deleted subvolumes; disk_bytes then commits.
            let _ = std::process::Command::new("btrfs")
                .args(["subvolume", "sync"])
                .arg(&vol)
                .status();
            disk_bytes(&s, &a) < 20 << 20
        }),
        "{}",
        s.inspect(&a)
    );
    assert_eq!(write(&s, &a, "/root/g", 40), (0, String::new()));

    // A rollback keeps the limit; a fork has its own, and starts with nothing charged.
    let snap = s.space_ok(&["snapshot", &a]).trim().to_string();
    s.space_ok(&["rollback", &a, &snap]);
    let (code, err) = write(&s, &a, "/root/h", 40);
    assert!(
        code != 0 && err.contains("Disk quota exceeded"),
        "{code} {err}"
    );
    let fork = s
        .space_ok(&["fork", &a, "--snapshot", &snap])
        .trim()
        .to_string();
    assert_eq!(s.inspect(&fork)["disk_mib"], 64);
    assert!(disk_bytes(&s, &fork) < 8 << 20, "{}", s.inspect(&fork));
    assert_eq!(write(&s, &fork, "/root/x", 40), (0, String::new()));
    let (code, err) = write(&s, &fork, "/root/y", 40);
    assert!(
        code != 0 && err.contains("Disk quota exceeded"),
        "{code} {err}"
    );
    // The source still has its own room: the fork's writes are not charged to it.
    assert_eq!(s.sh(&a, "rm -f /root/h; echo ok").1, "ok\n");

    // Removing a limited sandbox removes its quota group.
    for id in [&a, &fork, &b] {
        s.space_ok(&["rm", id]);
    }
    assert_eq!(space_groups(&s), Vec::<String>::new());
}

/// space's quota groups on the node's volume (`btrfs qgroup show`): level 1, tagged 0x5ACE.
fn space_groups(s: &Spaced) -> Vec<String> {
    let vol = s.data_dir().join("volume");
    let out = std::process::Command::new("btrfs")
        .args(["qgroup", "show", "--raw"])
        .arg(&vol)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|g| {
            g.strip_prefix("1/")
                .and_then(|n| n.parse::<u64>().ok())
                .is_some_and(|n| n >> 32 == 0x5ACE)
        })
        .map(str::to_string)
        .collect()
}

/// A crash between a remove's subvolumes and its quota group leaves a group no sandbox
/// names: the next start destroys it, and keeps a live sandbox's.
#[test]
fn a_stale_quota_group_is_swept_at_start() {
    let mut s = Spaced::start().unwrap();
    let id = s.create(&["--disk", "64"]);
    let live = space_groups(&s);
    assert_eq!(live.len(), 1, "{live:?}");
    let stale = format!("1/{}", 0x5ACE_u64 << 32 | 123);
    let vol = s.data_dir().join("volume");
    let st = std::process::Command::new("btrfs")
        .args(["qgroup", "create", &stale])
        .arg(&vol)
        .status()
        .unwrap();
    assert!(st.success());
    assert_eq!(space_groups(&s).len(), 2);
    s.kill9();
    s.spawn().unwrap();
    assert_eq!(space_groups(&s), live);
    assert_eq!(s.sh(&id, "echo ok").1, "ok\n");
    let (code, err) = write(&s, &id, "/root/f", 80);
    assert!(
        code != 0 && err.contains("Disk quota exceeded"),
        "{code} {err}"
    );

    // `space bench disk` measures limited against unlimited sandboxes in one run, then
    // leaves the node as it found it: its sandboxes and their groups are gone.
    let out = s.space_ok(&["bench", "disk", "-n", "2", "--mib", "2", "--json"]);
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    for m in ["create_ready_ms", "write_mb_per_s", "snapshot_ms"] {
        for side in ["unlimited", "limited"] {
            assert_eq!(r[m][side]["count"], 2, "{m} {side}: {r}");
        }
        assert!(r[m]["p50_ratio"].as_f64().unwrap() > 0.0, "{m}: {r}");
    }
    assert!(r["limited_disk_bytes"].as_u64().is_some(), "{r}");
    let (_, list) = s.call(Method::GET, "/v1/sandboxes", None);
    let ids: Vec<_> = list["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["id"].clone())
        .collect();
    assert_eq!(ids, vec![json!(id)], "{list}");
    assert_eq!(space_groups(&s), live);
}

#[test]
fn bad_disk_limits_are_refused_by_name() {
    let s = Spaced::start_with(&["--disk-quotas", "off"]).unwrap();
    for (body, want) in [
        (json!({"disk_mib": 0}), "disk_mib must be between 16"),
        (
            json!({"disk_mib": 1u64 << 40}),
            "disk_mib must be between 16",
        ),
        (json!({"disk_mib": "big"}), "expected u64"),
        (json!({"disk_mib": 64}), "no disk quotas"),
    ] {
        let (code, v) = s.call(Method::POST, "/v1/sandboxes", Some(body.clone()));
        assert_eq!(code, 400, "{body}: {v}");
        assert!(v.to_string().contains(want), "{body}: {v}");
    }
    // Nothing was made.
    let (_, list) = s.call(Method::GET, "/v1/sandboxes", None);
    assert_eq!(list["sandboxes"], json!([]), "{list}");
    // The disk bench says why it cannot run here, and leaves nothing behind.
    let out = s.space(&["bench", "disk", "-n", "1", "--mib", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no disk quotas"),
        "{err}"
    );
    let out = s.space(&["bench", "disk", "-n", "0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("-n must be between 1 and 1000"), "{err}");
    let (_, list) = s.call(Method::GET, "/v1/sandboxes", None);
    assert_eq!(list["sandboxes"], json!([]), "{list}");
    // Without a limit a create works as ever.
    s.create(&[]);
}

/// A tenant's disk quota (issue 15): its creates that name no limit get one (here the whole
/// quota, smaller than the 10 GiB default), which the node enforces inside; the sum of its
/// sandboxes' limits stays within the quota.
#[test]
fn a_tenants_disk_quota_gives_every_sandbox_a_limit_the_node_enforces() {
    let s = Spaced::start().unwrap();
    s.space_ok(&["tenant", "create", "team-d", "--max-disk", "64"]);
    let key = s.space_ok(&["key", "create", "--tenant", "team-d"]);
    let as_tenant = |args: &[&str]| {
        s.cli()
            .env("SPACE_API_KEY", key.trim())
            .args(args)
            .output()
            .unwrap()
    };
    let out = as_tenant(&["create"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert_eq!(s.inspect(&id)["disk_mib"], 64);
    let (code, err) = write(&s, &id, "/root/f", 96);
    assert!(
        code != 0 && err.contains("Disk quota exceeded"),
        "{code} {err}"
    );
    // The quota is taken: the next create is refused before anything is made.
    let out = as_tenant(&["create"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("disk quota of 64 MiB"),
        "{err}"
    );
    assert!(s.space_ok(&["tenant", "ls"]).contains("64 MiB disk"));
}
