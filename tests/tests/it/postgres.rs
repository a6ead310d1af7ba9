//! The control plane's store on PostgreSQL: the same SQL as the embedded SQLite default, run
//! against a real PostgreSQL server through a whole sandbox lifecycle and a restart.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

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

/// What the load clients saw: each key's sandbox, the ones they removed, how many answers
/// were 503 (with Retry-After), and any other answer (none may come).
#[derive(Debug, Default)]
struct Load {
    answered: BTreeMap<String, String>,
    removed: BTreeSet<String>,
    unavailable: usize,
    bad: Vec<String>,
}

/// Keys a load client uses at most, tries per request, and the time it runs at most.
const LOAD_KEYS: usize = 200;
const LOAD_TRIES: usize = 60;
const LOAD_LIMIT: Duration = Duration::from_secs(120);

/// Three clients looping create (with an `Idempotency-Key`, retried on 503 with the same
/// key), get and remove until `stop`.
fn load(url: String, key: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Load> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let http = reqwest::Client::new();
        let started = Instant::now();
        // One request, retried while the answer is 503: the final answer's status and body.
        let call = |method: reqwest::Method, path: String, idem: Option<String>| {
            let (http, url, key) = (http.clone(), url.clone(), key.clone());
            async move {
                let mut unavailable = 0;
                for _ in 0..LOAD_TRIES {
                    let mut req = http
                        .request(method.clone(), format!("{url}{path}"))
                        .bearer_auth(&key)
                        .timeout(Duration::from_secs(20));
                    if let Some(k) = &idem {
                        req = req
                            .header("Idempotency-Key", k)
                            .json(&serde_json::json!({}));
                    }
                    let r = match req.send().await {
                        Ok(r) => r,
                        Err(e) => return (0, Value::String(e.to_string()), unavailable),
                    };
                    let status = r.status().as_u16();
                    let retry = r.headers().get("retry-after").cloned();
                    let body: Value = r.json().await.unwrap_or(Value::Null);
                    if status != 503 {
                        return (status, body, unavailable);
                    }
                    if retry.is_none() || body["error"]["code"] != "unavailable" {
                        return (status, body, unavailable);
                    }
                    unavailable += 1;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                (503, Value::String("still 503".into()), unavailable)
            }
        };
        let client = |c: usize| {
            let (stop, call) = (stop.clone(), &call);
            async move {
                let mut out = Load::default();
                for k in 0..LOAD_KEYS {
                    if stop.load(Ordering::SeqCst) || started.elapsed() > LOAD_LIMIT {
                        break;
                    }
                    let idem = format!("load-{c}-{k}");
                    let (status, body, n) = call(
                        reqwest::Method::POST,
                        "/v1/sandboxes".into(),
                        Some(idem.clone()),
                    )
                    .await;
                    out.unavailable += n;
                    if !(200..300).contains(&status) {
                        out.bad.push(format!("create {idem}: {status} {body}"));
                        continue;
                    }
                    let id = body["id"].as_str().unwrap().to_owned();
                    out.answered.insert(idem, id.clone());
                    let (status, body, n) =
                        call(reqwest::Method::GET, format!("/v1/sandboxes/{id}"), None).await;
                    out.unavailable += n;
                    if status != 200 {
                        out.bad.push(format!("get {id}: {status} {body}"));
                    }
                    let (status, body, n) =
                        call(reqwest::Method::DELETE, format!("/v1/sandboxes/{id}"), None).await;
                    out.unavailable += n;
                    // A try answered 503 may have removed it before the store failed: its
                    // retry then finds it gone.
                    if (200..300).contains(&status) || (status == 404 && n > 0) {
                        out.removed.insert(id);
                    } else {
                        out.bad.push(format!("remove {id}: {status} {body}"));
                    }
                }
                out
            }
        };
        rt.block_on(async {
            let all = futures::future::join_all((0..3).map(client)).await;
            let mut load = Load::default();
            for l in all {
                load.answered.extend(l.answered);
                load.removed.extend(l.removed);
                load.unavailable += l.unavailable;
                load.bad.extend(l.bad);
            }
            load
        })
    })
}

/// PostgreSQL restarted under load (issue 14): while it is down the API answers 503 with
/// Retry-After (within the pool's 3 s wait, not a hang, and never a 500); sandboxes keep
/// running; once it is back the API recovers by itself, with nothing lost. Meanwhile three
/// clients loop create, get and remove, retrying each 503 with the same `Idempotency-Key`:
/// every key gets one sandbox, each answered create is there, and none is left over.
#[test]
fn a_postgresql_restart_is_503_with_retry_after_then_recovers() {
    let pg = Postgres::start().unwrap();
    let s = Spaced::start_with(&["--database-url", &pg.socket_url]).unwrap();
    let id = s.create(&[]);
    s.sh(&id, "echo kept > /root/f");
    let stop = Arc::new(AtomicBool::new(false));
    let clients = load(s.url.clone(), s.key.clone(), stop.clone());
    // Load before the outage.
    std::thread::sleep(Duration::from_secs(2));
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
    // Load after it too, then stop.
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::SeqCst);
    let load = clients.join().expect("the load clients");
    eprintln!(
        "load: {} creates answered, {} removed, {} answers were 503",
        load.answered.len(),
        load.removed.len(),
        load.unavailable
    );
    assert!(load.bad.is_empty(), "{:?}", load.bad);
    assert!(load.unavailable > 0, "the load never met the outage");
    let ids: BTreeSet<&String> = load.answered.values().collect();
    assert_eq!(ids.len(), load.answered.len(), "two keys, one sandbox");
    assert_eq!(load.removed.len(), load.answered.len());
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

/// Decision 0055: reconcile passes claim their sandboxes' leases in one statement, and on
/// PostgreSQL a lease row that another transaction holds locked is skipped, not waited on
/// (`FOR UPDATE SKIP LOCKED`). Two replicas claiming overlapping sets at once split them:
/// every lease goes to exactly one.
#[test]
fn lease_claims_skip_locked_rows_and_split_between_replicas() {
    use space_control::leases::{LEASE_TTL, Leases};
    let pg = Postgres::start().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let a = space_control::Store::open(&pg.url).await.unwrap();
        let b = space_control::Store::open(&pg.url).await.unwrap();
        let (la, lb) = (Leases::new(a.clone()), Leases::new(b.clone()));

        // A lapsed lease of a dead replica, its row locked by a transaction that stays open
        // for 5 s (another replica mid-claim).
        assert!(
            a.try_lease("sandbox/x", "replica-dead", Duration::from_millis(1))
                .await
                .unwrap()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
        let mut lock = pg
            .psql()
            .args([
                "-c",
                "BEGIN; SELECT name FROM leases WHERE name = 'sandbox/x' FOR UPDATE; \
                 SELECT pg_sleep(5); COMMIT;",
            ])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let t0 = Instant::now();
        let pass = la.sandboxes(["x", "y"]).await.unwrap();
        let waited = t0.elapsed();
        assert!(
            pass.holds("y") && !pass.holds("x"),
            "a locked row was taken"
        );
        assert!(
            waited < Duration::from_secs(2),
            "the claim waited {waited:?} on a locked row"
        );
        assert!(lock.wait().unwrap().success());
        // Unlocked, the lapsed lease is free to take.
        assert!(la.sandbox("x").await.unwrap().is_some());
        drop(pass);

        // Two replicas claim overlapping sets at once: each lease goes to exactly one of them.
        let ids: Vec<String> = (0..1000).map(|i| format!("s{i:04}")).collect();
        let (first, second) = tokio::join!(
            la.sandboxes(ids[..700].iter().map(String::as_str)),
            lb.sandboxes(ids[300..].iter().map(String::as_str)),
        );
        let (first, second) = (first.unwrap(), second.unwrap());
        for id in &ids {
            assert!(
                first.holds(id) ^ second.holds(id),
                "lease {id}: first {}, second {}",
                first.holds(id),
                second.holds(id)
            );
        }
        assert_eq!(first.len() + second.len(), ids.len());
        // The store agrees: one row per lease, named for its holder.
        let still = a
            .try_leases(
                &ids.iter()
                    .map(|i| format!("sandbox/{i}"))
                    .collect::<Vec<_>>(),
                la.holder(),
                LEASE_TTL,
            )
            .await
            .unwrap();
        assert_eq!(
            still.len(),
            first.len(),
            "the first replica renews only its own"
        );
    });
}
