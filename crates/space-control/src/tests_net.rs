//! Router tests of networking, secrets and ports (decision 0012), on the harness of `tests`.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

const SECRET_VALUE: &str = "sk-live-DO-NOT-LEAK-4242";

fn secret_body(value: &str, hosts: &[&str], header: &str) -> String {
    serde_json::json!({ "value": value, "hosts": hosts, "header": header }).to_string()
}

impl Harness {
    async fn put_secret(&self, name: &str) {
        let r = self
            .call(
                Method::PUT,
                &format!("/v1/secrets/{name}"),
                secret_body(SECRET_VALUE, &["api.x.com"], "Authorization: Bearer {}"),
            )
            .await;
        assert_eq!(
            r.status,
            StatusCode::OK,
            "{}",
            String::from_utf8_lossy(&r.body)
        );
    }

    async fn create_with(&self, body: serde_json::Value) -> Reply {
        self.call(Method::POST, "/v1/sandboxes", body.to_string())
            .await
    }

    /// Every event of a sandbox, as one string.
    async fn events_text(&self, id: &str) -> String {
        self.state.engine.events.flush().await;
        let r = self
            .call(Method::GET, &format!("/v1/sandboxes/{id}/events"), "")
            .await;
        assert_eq!(r.status, StatusCode::OK);
        String::from_utf8_lossy(&r.body).into_owned()
    }
}

#[tokio::test]
async fn secrets_crud_never_returns_values() {
    let h = harness().await;
    let r = h.call(Method::GET, "/v1/secrets", "").await;
    assert_eq!(r.json::<space_api::SecretList>().secrets, vec![]);
    h.put_secret("OPENAI_API_KEY").await;
    for uri in ["/v1/secrets", "/v1/secrets/OPENAI_API_KEY"] {
        let r = h.call(Method::GET, uri, "").await;
        assert_eq!(r.status, StatusCode::OK);
        let text = String::from_utf8_lossy(&r.body);
        assert!(!text.contains(SECRET_VALUE), "{text}");
        assert!(text.contains("api.x.com"), "{text}");
    }
    let info: space_api::SecretInfo = h
        .call(Method::GET, "/v1/secrets/OPENAI_API_KEY", "")
        .await
        .json();
    assert_eq!(info.header, "Authorization: Bearer {}");
    // The node gets the value through the secret source only.
    let src = h.state.engine.secret_source();
    assert_eq!(
        src.secret_value("OPENAI_API_KEY").await.as_deref(),
        Some(SECRET_VALUE)
    );
    // Sealed at rest.
    for f in ["space.db", "space.db-wal"] {
        let db = std::fs::read(h._dir.path().join("data").join(f)).unwrap_or_default();
        assert!(
            !db.windows(SECRET_VALUE.len())
                .any(|w| w == SECRET_VALUE.as_bytes())
        );
    }
    let wal = std::fs::read(h._dir.path().join("data/space.db-wal")).unwrap();
    assert!(
        wal.windows(14).any(|w| w == b"OPENAI_API_KEY"),
        "the row is in the WAL"
    );

    let r = h
        .call(Method::DELETE, "/v1/secrets/OPENAI_API_KEY", "")
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert!(src.secret_value("OPENAI_API_KEY").await.is_none());
    h.call(Method::DELETE, "/v1/secrets/OPENAI_API_KEY", "")
        .await
        .error(404, "not_found");
    h.call(Method::GET, "/v1/secrets/OPENAI_API_KEY", "")
        .await
        .error(404, "not_found");
}

#[tokio::test]
async fn bad_secrets_are_refused_with_the_reason() {
    let h = harness().await;
    let big = "v".repeat(space_api::MAX_SECRET_BYTES + 1);
    let cases: Vec<(&str, String, &str)> = vec![
        ("K", secret_body("v", &["*"], "X: {}"), "\"*\""),
        ("K", secret_body("v", &["*.com"], "X: {}"), "*.com"),
        ("K", secret_body("v", &[], "X: {}"), "host"),
        ("K", secret_body("v", &["1.2.3.4"], "X: {}"), "1.2.3.4"),
        (
            "K",
            secret_body("v", &["a.com"], "Authorization: Bearer"),
            "{}",
        ),
        ("K", secret_body("v", &["a.com"], "X: {}\r\nEvil: 1"), "CR"),
        ("K", secret_body("v", &["a.com"], "X {}"), "Name: template"),
        ("K", secret_body(&big, &["a.com"], "X: {}"), "8192"),
        ("K", secret_body("", &["a.com"], "X: {}"), "1 to 8192"),
        ("K", secret_body("a\nb", &["a.com"], "X: {}"), "CR, LF"),
        ("1K", secret_body("v", &["a.com"], "X: {}"), "secret name"),
    ];
    for (name, body, says) in cases {
        let msg = h
            .call(Method::PUT, &format!("/v1/secrets/{name}"), body.clone())
            .await
            .error(400, "invalid_argument");
        assert!(msg.contains(says), "{body}: {msg}");
        assert!(!msg.contains(&big), "the value must not be echoed");
    }
    let r = h.call(Method::GET, "/v1/secrets", "").await;
    assert!(r.json::<space_api::SecretList>().secrets.is_empty());
}

#[tokio::test]
async fn create_binds_secrets_and_passes_network_to_the_node() {
    let h = harness().await;
    h.put_secret("API_KEY").await;
    let r = h
        .create_with(serde_json::json!({
            "env": {"A": "1"},
            "network": {"egress": "allowlist", "allow": ["api.x.com", "203.0.113.0/24"]},
            "secrets": ["API_KEY"],
        }))
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let text = String::from_utf8_lossy(&r.body).into_owned();
    assert!(!text.contains(SECRET_VALUE));
    let sb: Sandbox = r.json();
    let net = sb.network.clone().unwrap();
    assert_eq!(net.egress, space_api::Egress::Allowlist);
    assert_eq!(net.allow, vec!["api.x.com", "203.0.113.0/24"]);
    assert_eq!(net.address.as_deref(), Some("10.213.0.2"));
    assert_eq!(net.gateway.as_deref(), Some("10.213.0.1"));
    assert_eq!(sb.secrets, vec!["API_KEY"]);

    let spec = h.node.spec(&sb.id);
    assert_eq!(spec.network.egress, space_node_api::net::Egress::Allowlist);
    assert_eq!(spec.network.allow.len(), 2);
    assert_eq!(spec.secrets.len(), 1);
    let b = &spec.secrets[0];
    assert_eq!(b.name, "API_KEY");
    assert_eq!(b.hosts, vec!["api.x.com"]);
    assert_eq!(b.header, "Authorization: Bearer {}");
    assert!(b.placeholder.starts_with("spc_ph_") && b.placeholder.len() == 39);
    assert!(
        spec.env
            .contains(&("API_KEY".to_string(), b.placeholder.clone()))
    );
    assert!(spec.env.contains(&("A".to_string(), "1".to_string())));
    let spec_text = serde_json::to_string(&spec).unwrap();
    assert!(!spec_text.contains(SECRET_VALUE));

    // GET shows the same; events name the policy, never the value.
    let got: Sandbox = h
        .call(Method::GET, &format!("/v1/sandboxes/{}", sb.id), "")
        .await
        .json();
    assert_eq!(got.network, sb.network);
    let events = h.events_text(&sb.id).await;
    assert!(events.contains("egress=allowlist"), "{events}");
    assert!(!events.contains(SECRET_VALUE));

    // Without a network: the node's default (open here), no secrets.
    let plain = h.create().await;
    assert_eq!(plain.network.unwrap().egress, space_api::Egress::Open);
    assert!(plain.secrets.is_empty());
    // Rules without an egress mean allowlist.
    let sb: Sandbox = h
        .create_with(serde_json::json!({"network": {"allow": ["*.x.com"]}}))
        .await
        .json();
    assert_eq!(sb.network.unwrap().egress, space_api::Egress::Allowlist);
}

#[tokio::test]
async fn default_egress_comes_from_the_config() {
    let h = harness_with(|c| c.default_egress = space_api::Egress::None).await;
    let sb = h.create().await;
    assert_eq!(sb.network.unwrap().egress, space_api::Egress::None);
    assert_eq!(
        h.node.spec(&sb.id).network.egress,
        space_node_api::net::Egress::None
    );
}

#[tokio::test]
async fn bad_create_requests_name_the_problem_and_create_nothing() {
    let h = harness().await;
    h.put_secret("K").await;
    let cases = [
        (
            serde_json::json!({"network": {"egress": "allowlist", "allow": ["10.0.0.0/33"]}}),
            "10.0.0.0/33",
        ),
        (
            serde_json::json!({"network": {"egress": "allowlist", "allow": ["bad..domain"]}}),
            "bad..domain",
        ),
        (
            serde_json::json!({"network": {"egress": "none", "allow": ["x.com"]}}),
            "none",
        ),
        (
            serde_json::json!({"secrets": ["NOPE"]}),
            "secret NOPE not found",
        ),
        (
            serde_json::json!({"secrets": ["K"], "env": {"K": "mine"}}),
            "env var K",
        ),
        (serde_json::json!({"secrets": ["K", "K"]}), "twice"),
        (serde_json::json!({"secrets": ["bad-name"]}), "bad-name"),
    ];
    for (body, says) in cases {
        let msg = h
            .create_with(body.clone())
            .await
            .error(400, "invalid_argument");
        assert!(msg.contains(says), "{body}: {msg}");
    }
    h.create_with(serde_json::json!({"network": {"egress": "closed"}}))
        .await
        .error(400, "invalid_argument");
    assert!(h.node.calls().iter().all(|c| !c.starts_with("create")));
    let list: space_api::SandboxList = h.call(Method::GET, "/v1/sandboxes", "").await.json();
    assert!(list.sandboxes.is_empty());
}

#[tokio::test]
async fn network_updates_apply_now_or_at_next_start() {
    let h = harness().await;
    let sb = h.create().await;
    let uri = format!("/v1/sandboxes/{}/network", sb.id);
    let r = h
        .call(
            Method::PUT,
            &uri,
            r#"{"egress":"allowlist","allow":["api.x.com"]}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let got: Sandbox = r.json();
    let net = got.network.unwrap();
    assert_eq!(net.egress, space_api::Egress::Allowlist);
    assert_eq!(net.allow, vec!["api.x.com"]);
    assert!(
        h.node
            .calls()
            .contains(&format!("network {} allowlist", sb.id))
    );
    let events = h.events_text(&sb.id).await;
    assert!(
        events.contains("egress=allowlist allow=api.x.com"),
        "{events}"
    );

    // A bad rule is 400 naming it, and changes nothing.
    let msg = h
        .call(
            Method::PUT,
            &uri,
            r#"{"egress":"allowlist","allow":["ok.com","300.0.0.0/8"]}"#,
        )
        .await
        .error(400, "invalid_argument");
    assert!(msg.contains("300.0.0.0/8"), "{msg}");
    let got: Sandbox = h
        .call(Method::GET, &format!("/v1/sandboxes/{}", sb.id), "")
        .await
        .json();
    assert_eq!(got.network.unwrap().allow, vec!["api.x.com"]);
    h.call(Method::PUT, &uri, r#"{"egress":"open","bogus":1}"#)
        .await
        .error(400, "invalid_argument");

    // A stopped sandbox keeps the policy for its next start; the node is not asked now.
    h.state
        .engine
        .store()
        .set_status(&sb.id, SandboxState::Stopped, None)
        .await
        .unwrap();
    let before = h.node.calls().len();
    let r = h.call(Method::PUT, &uri, r#"{"egress":"none"}"#).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(h.node.calls().len(), before);
    let row = h
        .state
        .engine
        .store()
        .get_sandbox(&sb.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.spec.network.egress, space_api::Egress::None);
    let spec = crate::engine::node_spec(&row.id, &row.spec);
    assert_eq!(spec.network.egress, space_node_api::net::Egress::None);

    // Unknown and removed sandboxes: 404.
    h.call(
        Method::PUT,
        "/v1/sandboxes/zzzzzzzzzzzzzzzzzzzz/network",
        r#"{"egress":"open"}"#,
    )
    .await
    .error(404, "not_found");
    let r = h
        .call(Method::DELETE, &format!("/v1/sandboxes/{}", sb.id), "")
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    h.call(Method::PUT, &uri, r#"{"egress":"open"}"#)
        .await
        .error(404, "not_found");
}

#[tokio::test]
async fn reconciler_reapplies_a_drifted_policy() {
    let h = harness().await;
    let sb: Sandbox = h
        .create_with(serde_json::json!({"network": {"egress": "none"}}))
        .await
        .json();
    let engine = h.state.engine.clone();
    let mut backoff = Backoff::default();
    assert_eq!(engine.reconcile_once(&mut backoff).await.unwrap(), 0);
    // The node lost the policy (say, an update failed halfway).
    if let Some(n) = h
        .node
        .sandboxes
        .lock()
        .unwrap()
        .get_mut(&sb.id)
        .and_then(|s| s.network.as_mut())
    {
        n.egress = space_node_api::net::Egress::Open;
    }
    assert_eq!(engine.reconcile_once(&mut backoff).await.unwrap(), 1);
    assert!(h.node.calls().contains(&format!("network {} none", sb.id)));
    assert_eq!(engine.reconcile_once(&mut backoff).await.unwrap(), 0);
}

#[tokio::test]
async fn fork_and_rollback_keep_network_and_secret_bindings() {
    let h = harness().await;
    h.put_secret("K").await;
    let sb: Sandbox = h
        .create_with(serde_json::json!({
            "network": {"egress": "allowlist", "allow": ["api.x.com"]},
            "secrets": ["K"],
        }))
        .await
        .json();
    let source = h.node.spec(&sb.id);
    let base = format!("/v1/sandboxes/{}", sb.id);
    let snap: space_api::Snapshot = h
        .call(Method::POST, &format!("{base}/snapshots"), "")
        .await
        .json();
    let r = h
        .call(
            Method::POST,
            &format!("{base}/fork"),
            format!(r#"{{"snapshot":"{}"}}"#, snap.id),
        )
        .await;
    assert!(
        r.status.is_success(),
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let forks: space_api::SandboxList = r.json();
    let fork = &forks.sandboxes[0];
    assert_eq!(fork.secrets, vec!["K"]);
    assert_eq!(fork.network.as_ref().unwrap().allow, vec!["api.x.com"]);
    let fs = h.node.spec(&fork.id);
    assert_eq!(fs.network, source.network);
    assert_eq!(fs.secrets, source.secrets);
    // The source's snapshot list names its head and the fork (the console draws both).
    let snapshots = || async {
        h.call(Method::GET, &format!("{base}/snapshots"), "")
            .await
            .json::<space_api::SnapshotList>()
    };
    let list = snapshots().await;
    assert_eq!(list.head.as_deref(), Some(snap.id.as_str()));
    assert_eq!(
        list.forks,
        vec![space_api::ForkOf {
            sandbox: fork.id.clone(),
            snapshot: snap.id.clone()
        }]
    );
    // A fork's own snapshot still names it; a removed fork is no longer listed.
    let r = h
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{}/snapshots", fork.id),
            "",
        )
        .await;
    assert!(r.status.is_success());
    let list = snapshots().await;
    assert_eq!(list.forks.len(), 1, "{:?}", list.forks);
    let r = h
        .call(Method::DELETE, &format!("/v1/sandboxes/{}", fork.id), "")
        .await;
    assert!(r.status.is_success());
    let list = snapshots().await;
    assert!(list.forks.is_empty(), "{:?}", list.forks);

    let r = h
        .call(
            Method::POST,
            &format!("{base}/rollback"),
            format!(r#"{{"snapshot":"{}"}}"#, snap.id),
        )
        .await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let rolled = h.node.spec(&sb.id);
    assert_eq!(rolled.network, source.network);
    assert_eq!(rolled.secrets, source.secrets);
    assert_eq!(rolled.env, source.env);
}

#[tokio::test]
async fn port_urls_check_their_input() {
    let h = harness().await;
    let sb = h.create().await;
    let uri = format!("/v1/sandboxes/{}/ports", sb.id);
    for bad in [r#"{"port":0}"#, r#"{"port":65536}"#, r#"{"port":-1}"#, "{}"] {
        h.call(Method::POST, &uri, bad)
            .await
            .error(400, "invalid_argument");
    }
    // The node's own listeners in the sandbox's network are nobody's port URL.
    for (port, what) in [(53, "DNS resolver"), (15001, "egress proxy")] {
        let msg = h
            .call(Method::POST, &uri, format!(r#"{{"port":{port}}}"#))
            .await
            .error(400, "invalid_argument");
        assert!(msg.contains(what), "{msg}");
        let token = h.state.engine.ports.token(&sb.id, port);
        h.call(Method::GET, &format!("/p/{token}/"), "")
            .await
            .error(400, "invalid_argument");
    }
    h.call(
        Method::POST,
        "/v1/sandboxes/zzzzzzzzzzzzzzzzzzzz/ports",
        r#"{"port":80}"#,
    )
    .await
    .error(404, "not_found");
    // No Host (nor authority): nothing to build the URL on.
    let msg = h
        .call(Method::POST, &uri, r#"{"port":8080}"#)
        .await
        .error(400, "invalid_argument");
    assert!(msg.contains("Host"), "{msg}");
    let req = Request::builder()
        .method(Method::POST)
        .uri(&uri)
        .header("authorization", format!("Bearer {}", h.key))
        .header("host", "space.example:7070")
        .body(Body::from(r#"{"port":8080}"#))
        .unwrap();
    let r = h.send(req).await;
    assert_eq!(r.status, StatusCode::OK);
    let p: space_api::PortInfo = r.json();
    assert_eq!(p.port, 8080);
    let prefix = format!("http://space.example:7070/p/{}.8080.", sb.id);
    assert!(
        p.url.starts_with(&prefix) && p.url.ends_with('/'),
        "{}",
        p.url
    );
}

/// A one-connection HTTP/1.1 upstream: answers with the request line it got and the body,
/// or (for an upgrade) 101 and then echoes bytes.
async fn upstream() -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let head_end = loop {
                    let n = s.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
                let line = head.lines().next().unwrap_or("").to_string();
                if head.to_ascii_lowercase().contains("upgrade: websocket") {
                    s.write_all(
                        b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
                    )
                    .await
                    .unwrap();
                    let mut b = [0u8; 64];
                    while let Ok(n) = s.read(&mut b).await {
                        if n == 0 || s.write_all(&b[..n]).await.is_err() {
                            break;
                        }
                    }
                    return;
                }
                let len: usize = head
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse().unwrap())
                    })
                    .unwrap_or(0);
                let mut body = buf[head_end..].to_vec();
                while body.len() < len {
                    let n = s.read(&mut chunk).await.unwrap();
                    body.extend_from_slice(&chunk[..n]);
                }
                let fwd = head
                    .lines()
                    .find(|l| l.to_ascii_lowercase().starts_with("x-forwarded-prefix"))
                    .unwrap_or("")
                    .to_string();
                let reply = format!("{line}|{}|{fwd}", String::from_utf8_lossy(&body));
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nX-Up: 1\r\n\r\n{reply}",
                    reply.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    (addr, task)
}

async fn raw_http(addr: std::net::SocketAddr, req: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn the_port_proxy_forwards_http_and_websockets() {
    let h = harness().await;
    let sb = h.create().await;
    let (up, _task) = upstream().await;
    h.node.ports.lock().unwrap().insert(8080, up);
    let token = h.state.engine.ports.token(&sb.id, 8080);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = app(h.state.clone());
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });

    // GET with a path and query; no API key needed.
    let resp = raw_http(
        addr,
        &format!("GET /p/{token}/a/b?x=1 HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("GET /a/b?x=1 HTTP/1.1||"), "{resp}");
    assert!(
        resp.contains(&format!("x-forwarded-prefix: /p/{token}")),
        "{resp}"
    );
    assert!(resp.to_ascii_lowercase().contains("x-up: 1"), "{resp}");
    // The bare token path is "/"; bodies pass.
    let resp = raw_http(
        addr,
        &format!(
            "POST /p/{token} HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello"
        ),
    )
    .await;
    assert!(resp.contains("POST / HTTP/1.1|hello|"), "{resp}");

    // Bad tokens are 404, whatever is wrong.
    let forged = format!("{}.8080.{}", sb.id, "0".repeat(32));
    let other_port = token.replacen(".8080.", ".8081.", 1);
    for t in [forged.as_str(), other_port.as_str(), "x", "a.b.c"] {
        let resp = raw_http(
            addr,
            &format!("GET /p/{t}/ HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"),
        )
        .await;
        assert!(resp.starts_with("HTTP/1.1 404"), "{t}: {resp}");
        assert!(resp.contains("no such port URL"), "{resp}");
    }
    // A port nobody listens on: 502 unavailable.
    let t9 = h.state.engine.ports.token(&sb.id, 9);
    let resp = raw_http(
        addr,
        &format!("GET /p/{t9}/ HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 502"), "{resp}");
    assert!(resp.contains("\"unavailable\""), "{resp}");

    // WebSocket: 101, then bytes both ways.
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(
        format!(
            "GET /p/{token}/ws HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut got = Vec::new();
    let mut b = [0u8; 1024];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&b[..n]);
    }
    let head = String::from_utf8_lossy(&got).into_owned();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    s.write_all(b"ping-frame").await.unwrap();
    let mut echo = [0u8; 10];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut echo))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&echo, b"ping-frame");

    // A deleted sandbox's URLs stop working (404).
    let r = h
        .call(Method::DELETE, &format!("/v1/sandboxes/{}", sb.id), "")
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let resp = raw_http(
        addr,
        &format!("GET /p/{token}/ HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 404"), "{resp}");
}
