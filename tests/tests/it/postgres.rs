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

/// PostgreSQL restarted under load (issue 14): while it is down the API answers 503 with
/// Retry-After (within the pool's 3 s wait, not a hang, and never a 500); sandboxes keep
/// running; once it is back the API recovers by itself, with nothing lost.
#[test]
fn a_postgresql_restart_is_503_with_retry_after_then_recovers() {
    let pg = Postgres::start().unwrap();
    let s = Spaced::start_with(&["--database-url", &pg.socket_url]).unwrap();
    let id = s.create(&[]);
    s.sh(&id, "echo kept > /root/f");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let get = |path: &str| {
        rt.block_on(async {
            let started = std::time::Instant::now();
            let r = s
                .req(reqwest::Method::GET, path)
                .timeout(std::time::Duration::from_secs(20))
                .send()
                .await
                .expect("the API answers while the database is down");
            let retry = r
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_owned());
            let status = r.status().as_u16();
            let body: Value = r.json().await.unwrap_or(Value::Null);
            (status, retry, body, started.elapsed())
        })
    };
    assert_eq!(get(&format!("/v1/sandboxes/{id}")).0, 200);

    pg.stop_server().unwrap();
    // A bounded burst of reads and creates while it is down.
    for i in 0..6 {
        let path = if i % 2 == 0 {
            format!("/v1/sandboxes/{id}")
        } else {
            "/v1/sandboxes".to_owned()
        };
        let (status, retry, body, took) = get(&path);
        assert_eq!(status, 503, "{path}: {body}");
        assert_eq!(retry.as_deref(), Some("1"), "{path}");
        assert_eq!(body["error"]["code"], "unavailable", "{body}");
        assert!(
            took < std::time::Duration::from_secs(10),
            "{path} took {took:?}"
        );
    }
    let out = s.space(&["create"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("database"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Back: the pool reconnects by itself, and the sandbox kept its files.
    pg.start_server().unwrap();
    assert!(
        space_tests::eventually(std::time::Duration::from_secs(20), || get(&format!(
            "/v1/sandboxes/{id}"
        ))
        .0 == 200),
        "the API did not recover:\n{}",
        s.log_tail()
    );
    assert_eq!(s.sh(&id, "cat /root/f").1, "kept\n");
    let list: Value = serde_json::from_str(&s.space_ok(&["ls", "--json"])).unwrap();
    let n = list
        .as_array()
        .or_else(|| list["sandboxes"].as_array())
        .map_or(0, Vec::len);
    assert_eq!(n, 1, "a create during the outage left a sandbox: {list}");
    s.space_ok(&["rm", &id]);
}

/// Event retention's batched DELETE on PostgreSQL (the unit test runs it on SQLite): old
/// events go in batches, recent ones stay.
#[test]
fn event_retention_on_postgresql() {
    use space_control::events::{EventRow, prune_older_than};
    use space_control::store::{Store, now_ms};
    let pg = Postgres::start().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = Store::open(&pg.socket_url).await.unwrap();
        let day = 86_400_000;
        let now = now_ms();
        let at = |time: i64, seq: i64| EventRow {
            id: (time << 12) | seq,
            time,
            actor: "node".into(),
            sandbox_id: "aaaaaaaaaaaaaaaaaaaa".into(),
            action: "exec".into(),
            result: "ok".into(),
            detail: String::new(),
        };
        let old: Vec<EventRow> = (0..25).map(|i| at(now - 40 * day, i)).collect();
        let recent: Vec<EventRow> = (0..5).map(|i| at(now - day, i)).collect();
        store.insert_events(&old).await.unwrap();
        store.insert_events(&recent).await.unwrap();
        assert_eq!(store.prune_events(now - 30 * day, 10).await.unwrap(), 10);
        let keep = std::time::Duration::from_secs(30 * 86_400);
        assert_eq!(prune_older_than(&store, keep).await.unwrap(), 15);
        let left = store
            .list_events("aaaaaaaaaaaaaaaaaaaa", i64::MIN, 1000)
            .await
            .unwrap();
        assert_eq!(left.len(), 5);
    });
}
