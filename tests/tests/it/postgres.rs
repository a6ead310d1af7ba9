//! The control plane's store on PostgreSQL: the same SQL as the embedded SQLite default, run
//! against a real PostgreSQL server through a whole sandbox lifecycle and a restart.

use serde_json::Value;
use space_tests::{Postgres, Spaced};

#[test]
fn lifecycle_on_postgresql() {
    let pg = Postgres::start().unwrap();
    // Through PostgreSQL's unix socket: spaced stays in its own network namespace.
    let mut s = Spaced::start_with(&["--database-url", &pg.socket_url]).unwrap();
    assert!(
        !s.data_dir().join("space.db").exists(),
        "spaced made a SQLite store although PostgreSQL was given"
    );
    let id = s.create(&["--env", "K=v", "--memory", "128"]);
    assert_eq!(
        s.space_ok(&["exec", &id, "--", "sh", "-c", "echo $K"]),
        "v\n"
    );
    s.sh(&id, "echo one > /root/f");
    let snap = s
        .space_ok(&["snapshot", &id, "--label", "first"])
        .trim()
        .to_string();
    s.sh(&id, "echo two > /root/f");
    s.space_ok(&["rollback", &id, &snap]);
    assert_eq!(s.space_ok(&["exec", &id, "--", "cat", "/root/f"]), "one\n");
    s.space_ok(&["pause", &id]);
    s.space_ok(&["resume", &id]);

    // The store survives a restart and still agrees with the node.
    s.kill9();
    s.spawn().unwrap();
    let info: Value = serde_json::from_str(&s.space_ok(&["inspect", &id])).unwrap();
    assert_eq!(info["state"], "running");
    assert_eq!(info["memory_mib"], 128);
    let snaps = s.space_ok(&["snapshots", &id]);
    assert!(snaps.contains(&snap) && snaps.contains("first"), "{snaps}");
    s.space_ok(&["rm", &id]);
    let out = s.space(&["inspect", &id]);
    assert_eq!(out.status.code(), Some(1));
}
