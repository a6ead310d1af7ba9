//! Router tests of warm pools (decision 0013), on the harness and fake node of `tests`.

use space_api::{Pool, PoolList};

use super::*;
use crate::pools::PoolRow;

impl Harness {
    /// The fake node's `set_pool` calls so far ("pool TEMPLATE MIN MAX"), then forgets them
    /// all (every call, not only pools).
    fn take_pool_calls(&self) -> Vec<String> {
        let mut calls = self.node.calls.lock().unwrap();
        let pools = calls
            .iter()
            .filter(|c| c.starts_with("pool "))
            .cloned()
            .collect();
        calls.clear();
        pools
    }

    async fn put_pool(&self, template: &str, body: &str) -> Reply {
        self.call(
            Method::PUT,
            &format!("/v1/templates/{template}/pool"),
            body.to_string(),
        )
        .await
    }

    async fn get_pool(&self, template: &str) -> Reply {
        self.call(
            Method::GET,
            &format!("/v1/templates/{template}/pool"),
            Body::empty(),
        )
        .await
    }

    async fn import(&self, name: &str) {
        let r = self
            .call(Method::PUT, &format!("/v1/templates/{name}"), "tar")
            .await;
        assert_eq!(r.status, StatusCode::CREATED);
    }
}

#[tokio::test]
async fn set_get_and_list_round_trip_and_store_the_request() {
    let h = harness().await;
    let r = h.put_pool("base", r#"{"min": 2, "max": 8}"#).await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let p: Pool = r.json();
    assert_eq!(
        (p.template.as_str(), p.runtime.as_str(), p.min, p.max),
        ("base", "namespace", 2, 8)
    );
    assert_eq!((p.target, p.starting, p.warning.as_deref()), (2, 2, None));
    assert_eq!(h.take_pool_calls(), ["pool base 2 8"]);

    // max defaults to min; the runtime may be named.
    h.import("py3").await;
    let r = h
        .put_pool("py3", r#"{"min": 3, "runtime": "namespace"}"#)
        .await;
    let p: Pool = r.json();
    assert_eq!((p.min, p.max), (3, 3));
    assert_eq!(h.take_pool_calls(), ["pool py3 3 3"]);

    let got: Pool = h.get_pool("base").await.json();
    assert_eq!((got.template.as_str(), got.min, got.max), ("base", 2, 8));
    let list: PoolList = h.call(Method::GET, "/v1/pools", Body::empty()).await.json();
    let names: Vec<&str> = list.pools.iter().map(|p| p.template.as_str()).collect();
    assert_eq!(names, ["base", "py3"]);

    let rows = h.state.engine.store().list_pools().await.unwrap();
    let sizes: Vec<(&str, u32, u32, &str)> = rows
        .iter()
        .map(|r| (r.template.as_str(), r.min, r.max, r.runtime.as_str()))
        .collect();
    assert_eq!(
        sizes,
        [("base", 2, 8, "namespace"), ("py3", 3, 3, "namespace")]
    );

    // 0 turns a pool off, and is stored like any size.
    let p: Pool = h.put_pool("py3", r#"{"min": 0}"#).await.json();
    assert_eq!((p.min, p.max), (0, 0));
    let row = h
        .state
        .engine
        .store()
        .get_pool("py3")
        .await
        .unwrap()
        .unwrap();
    assert_eq!((row.min, row.max), (0, 0));
}

#[tokio::test]
async fn bad_requests_are_refused_with_clear_errors_and_reach_no_node() {
    let h = harness().await;
    let msg = h
        .put_pool("base", r#"{"min": 5, "max": 3}"#)
        .await
        .error(400, "invalid_argument");
    assert!(msg.contains("min (5)") && msg.contains("max (3)"), "{msg}");
    let msg = h
        .put_pool("base", r#"{"min": 1, "runtime": "firecracker"}"#)
        .await
        .error(400, "invalid_argument");
    assert!(
        msg.contains("firecracker") && msg.contains("microvm") && msg.contains("namespace"),
        "{msg}"
    );
    let msg = h
        .put_pool("nope", r#"{"min": 1}"#)
        .await
        .error(404, "not_found");
    assert_eq!(msg, "template nope not found");
    let msg = h
        .put_pool("Bad..Name", r#"{"min": 1}"#)
        .await
        .error(400, "invalid_argument");
    assert!(msg.contains("invalid template name"), "{msg}");
    for (body, needle) in [
        (r#"{"max": 3}"#, "missing field `min`"),
        (r#"{"min": 1, "size": 3}"#, "unknown field `size`"),
        (r#"{"min": -1}"#, "invalid JSON body"),
        (r#"{"min": 4294967296}"#, "invalid JSON body"),
        (r#"{"min": "4"}"#, "invalid JSON body"),
        ("{", "invalid JSON body"),
        ("[1]", "must be a JSON object"),
        ("", "a JSON request body is required"),
    ] {
        let msg = h
            .put_pool("base", body)
            .await
            .error(400, "invalid_argument");
        assert!(msg.contains(needle), "{body}: {msg}");
    }
    // None of these got to the node, and nothing was stored.
    assert!(h.take_pool_calls().is_empty());
    assert!(
        h.state
            .engine
            .store()
            .list_pools()
            .await
            .unwrap()
            .is_empty()
    );

    // GET: a template without a pool, an unknown template, a bad name.
    let msg = h.get_pool("base").await.error(404, "not_found");
    assert_eq!(msg, "template base has no warm pool");
    let msg = h.get_pool("nope").await.error(404, "not_found");
    assert_eq!(msg, "template nope not found");
    h.get_pool("Bad..Name").await.error(400, "invalid_argument");

    // Every pool route needs the key.
    for (method, uri) in [
        (Method::GET, "/v1/pools"),
        (Method::GET, "/v1/templates/base/pool"),
        (Method::PUT, "/v1/templates/base/pool"),
    ] {
        let req = Request::builder()
            .method(method.clone())
            .uri(uri)
            .body(Body::from(r#"{"min": 1}"#))
            .unwrap();
        h.send(req).await.error(401, "unauthorized");
    }
    assert!(h.take_pool_calls().is_empty());
}

#[tokio::test]
async fn sizes_beyond_capacity_are_clamped_with_a_warning_and_stored_as_asked() {
    let h = harness().await;
    let r = h
        .put_pool("base", r#"{"min": 1000000, "max": 1000000}"#)
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let p: Pool = r.json();
    assert_eq!((p.min, p.max), (FAKE_POOL_CAPACITY, FAKE_POOL_CAPACITY));
    let w = p.warning.expect("a warning");
    assert!(w.contains(&FAKE_POOL_CAPACITY.to_string()), "{w}");
    // The request, not the clamped sizes, is what a later start hands the node.
    let row = h
        .state
        .engine
        .store()
        .get_pool("base")
        .await
        .unwrap()
        .unwrap();
    assert_eq!((row.min, row.max), (1_000_000, 1_000_000));
}

#[tokio::test]
async fn restore_pushes_stored_pools_and_the_default_only_to_a_base_without_one() {
    // Stored pools are pushed again as they were requested; base has one: no default.
    let h = harness().await;
    h.import("py3").await;
    h.put_pool("py3", r#"{"min": 1, "max": 2}"#).await;
    h.put_pool("base", r#"{"min": 3, "max": 500}"#).await;
    h.take_pool_calls();
    h.state.engine.restore_pools().await;
    assert_eq!(h.take_pool_calls(), ["pool base 3 500", "pool py3 1 2"]);

    // A base turned off stays off (0 0 is pushed, not the default).
    h.put_pool("base", r#"{"min": 0}"#).await;
    h.take_pool_calls();
    h.state.engine.restore_pools().await;
    assert_eq!(h.take_pool_calls(), ["pool base 0 0", "pool py3 1 2"]);

    // Nothing stored: the default goes to base, and is not stored.
    let h = harness().await;
    h.state.engine.restore_pools().await;
    assert_eq!(h.take_pool_calls(), ["pool base 4 32"]);
    assert!(
        h.state
            .engine
            .store()
            .list_pools()
            .await
            .unwrap()
            .is_empty()
    );
    let p: Pool = h.get_pool("base").await.json();
    assert_eq!((p.min, p.max), (4, 32));

    // A configured default, or none.
    let h = harness_with(|c| {
        c.default_pool = Some(space_node_api::PoolConfig {
            min: 1,
            max: 2,
            microvm: false,
        })
    })
    .await;
    h.state.engine.restore_pools().await;
    assert_eq!(h.take_pool_calls(), ["pool base 1 2"]);
    let h = harness_with(|c| c.default_pool = None).await;
    h.state.engine.restore_pools().await;
    assert!(h.take_pool_calls().is_empty());
    // The default pool follows the default template, and so do creates that name none.
    let h = harness_with(|c| c.default_template = "minimal".into()).await;
    h.state.engine.restore_pools().await;
    assert_eq!(h.take_pool_calls(), ["pool minimal 4 32"]);
    assert_eq!(h.create().await.template, "minimal");
}

#[tokio::test]
async fn a_node_that_restarted_gets_its_pools_again_in_the_next_pass() {
    use std::sync::atomic::Ordering::Relaxed;
    let h = harness().await;
    h.put_pool("base", r#"{"min": 2, "max": 3}"#).await;
    h.take_pool_calls();
    let pass = || async {
        let mut backoff = crate::reconcile::Backoff::default();
        h.state.engine.reconcile_once(&mut backoff).await.unwrap();
    };
    // The first pass that sees the node hands it its pools; the next ones do not.
    h.node.started_unix_ms.store(1_000, Relaxed);
    pass().await;
    assert_eq!(h.take_pool_calls(), ["pool base 2 3"]);
    pass().await;
    assert!(h.take_pool_calls().is_empty());
    // The node started again: it gets them again, once.
    h.node.started_unix_ms.store(2_000, Relaxed);
    pass().await;
    pass().await;
    assert_eq!(h.take_pool_calls(), ["pool base 2 3"]);
}

#[tokio::test]
async fn restore_failures_are_logged_and_the_rest_still_applied() {
    let h = harness().await;
    let store = h.state.engine.store();
    let row = |t: &str, runtime: &str| PoolRow {
        template: t.into(),
        min: 1,
        max: 1,
        runtime: runtime.into(),
        updated_at: 1,
    };
    // A template the node no longer has, a microvm pool, and a row of an unknown runtime.
    store.put_pool(&row("gone", "namespace")).await.unwrap();
    store.put_pool(&row("vm", "microvm")).await.unwrap();
    store.put_pool(&row("odd", "firecracker")).await.unwrap();
    h.state.engine.restore_pools().await;
    // "gone" was tried (and failed), "vm" applied as microvm, "odd" skipped, and base got
    // the default.
    assert_eq!(
        h.take_pool_calls(),
        ["pool gone 1 1", "pool vm 1 1 microvm", "pool base 4 32"]
    );
    // A stored pool the node does not keep is still shown, with nothing ready.
    let p: Pool = h.get_pool("gone").await.json();
    assert_eq!((p.min, p.max, p.ready, p.target), (1, 1, 0, 0));
}

#[tokio::test]
async fn serve_restores_pools_at_start() {
    let h = harness_with(|c| c.shutdown_timeout = std::time::Duration::from_millis(200)).await;
    // A node agent that reports when it started, as every real one does.
    h.node
        .started_unix_ms
        .store(1, std::sync::atomic::Ordering::Relaxed);
    h.state
        .engine
        .store()
        .put_pool(&PoolRow {
            template: "base".into(),
            min: 6,
            max: 7,
            runtime: "namespace".into(),
            updated_at: 1,
        })
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(crate::serve(listener, h.state.clone(), async {
        let _ = rx.await;
    }));
    let c = space_api::Client::new(&format!("http://{addr}"), &h.key).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let pools = loop {
        let pools = c.list_pools().await.unwrap();
        if !pools.is_empty() || std::time::Instant::now() > deadline {
            break pools;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    };
    assert_eq!(pools.len(), 1, "{pools:?}");
    assert_eq!((pools[0].min, pools[0].max), (6, 7));
    // The typed client round trip.
    let p = c
        .set_pool(
            "base",
            &space_api::SetPool {
                min: 1,
                max: Some(2),
                runtime: None,
            },
        )
        .await
        .unwrap();
    assert_eq!((p.min, p.max), (1, 2));
    assert_eq!(c.get_pool("base").await.unwrap(), p);
    let e = c.get_pool("nope").await.unwrap_err();
    assert!(e.to_string().contains("template nope not found"), "{e}");
    tx.send(()).unwrap();
    server.await.unwrap().unwrap();
}

#[tokio::test]
async fn nodes_and_the_cluster_show_capacity_and_what_sandboxes_claim() {
    let h = harness().await;
    let a = h.create().await;
    let b = h.create().await;
    let nodes: space_api::NodeList = h.call(Method::GET, "/v1/nodes", Body::empty()).await.json();
    assert_eq!(nodes.nodes.len(), 1);
    let n = &nodes.nodes[0];
    assert_eq!(
        (n.name.as_str(), n.state.as_str(), n.cpus, n.sandboxes),
        ("fake", "ready", 2, 2)
    );
    assert_eq!(n.runtimes, ["namespace"]);
    // Creating, running and paused sandboxes hold their limits.
    assert_eq!(n.allocated_cpu, a.cpu + b.cpu);
    assert_eq!(n.allocated_memory_mib, a.memory_mib + b.memory_mib);

    let r = h
        .call(
            Method::DELETE,
            &format!("/v1/sandboxes/{}", a.id),
            Body::empty(),
        )
        .await;
    assert_eq!(
        r.status,
        StatusCode::NO_CONTENT,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let c: space_api::ClusterStatus = h
        .call(Method::GET, "/v1/cluster", Body::empty())
        .await
        .json();
    assert_eq!((c.nodes, c.nodes_ready, c.cpus), (1, 1, 2));
    assert_eq!(
        (c.memory_bytes, c.memory_available_bytes),
        (8 << 30, 6 << 30)
    );
    assert_eq!(
        (c.allocated_cpu, c.allocated_memory_mib),
        (b.cpu, b.memory_mib)
    );
    assert_eq!(c.sandboxes.get("running"), Some(&1));
    assert!(
        c.sandboxes.keys().all(|k| k == "running" || k == "deleted"),
        "{:?}",
        c.sandboxes
    );
}

#[tokio::test]
async fn join_tokens_and_node_removal_through_the_api() {
    let mut h = harness().await;
    // All-in-one leads no cluster.
    let r = h.call(Method::POST, "/v1/nodes/tokens", "{}").await;
    assert!(r.error(409, "conflict").contains("one node of its own"));
    h.call(Method::DELETE, "/v1/nodes/abc", Body::empty())
        .await
        .error(409, "conflict");

    // A control plane that leads one: tokens pin its CA, bad input is refused, nothing
    // joined yet.
    let dir = tempfile::tempdir().unwrap();
    let cp = crate::ControlPlane::open_cluster(
        crate::ControlConfig::new(dir.path().join("data")),
        None,
        "10.0.0.1:7443".into(),
    )
    .await
    .unwrap();
    let cluster = cp.cluster().unwrap();
    h.key = std::fs::read_to_string(&cp.admin_key_path)
        .unwrap()
        .trim()
        .to_owned();
    h.state = cp.state;
    let t: space_api::JoinToken = h
        .call(Method::POST, "/v1/nodes/tokens", r#"{"ttl_secs": 60}"#)
        .await
        .json();
    let parsed = space_rpc::join::Token::parse(&t.token).unwrap();
    assert_eq!(parsed.ca_sha256, cluster.ca_sha256);
    assert!(
        t.join_command.contains("--control 10.0.0.1:7443"),
        "{}",
        t.join_command
    );
    for bad in [
        r#"{"ttl_secs": 0}"#,
        r#"{"ttl_secs": 86401}"#,
        r#"{"ttl": 5}"#,
        "[]",
    ] {
        h.call(Method::POST, "/v1/nodes/tokens", bad)
            .await
            .error(400, "invalid_argument");
    }
    h.call(Method::DELETE, "/v1/nodes/abc", Body::empty())
        .await
        .error(404, "not_found");
    let nodes: space_api::NodeList = h.call(Method::GET, "/v1/nodes", Body::empty()).await.json();
    assert!(nodes.nodes.is_empty());
    // With no node, a create says why.
    let r = h.call(Method::POST, "/v1/sandboxes", "{}").await;
    assert!(r.error(503, "unavailable").contains("no node has joined"));
}
