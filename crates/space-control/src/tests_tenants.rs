//! Router tests of tenants and scoped keys (decision 0040), on the harness and fake node of
//! `tests`: every route, tried with another tenant's key and with a read-only key.

use space_api::tenant::{ApiKey, ApiKeyList, CreatedKey, Tenant, TenantList};

use super::*;
use crate::tenants::{Access, access};

impl Harness {
    /// A request with `key` instead of the admin key.
    async fn call_as(&self, key: &str, method: Method, uri: &str, body: impl Into<Body>) -> Reply {
        let req = Request::builder()
            .method(method)
            .uri(uri)
            .header("authorization", format!("Bearer {key}"))
            .header("content-type", "application/json")
            .body(body.into())
            .unwrap();
        self.send(req).await
    }

    async fn tenant(&self, id: &str) {
        let r = self
            .call(Method::POST, "/v1/tenants", format!(r#"{{"id":"{id}"}}"#))
            .await;
        assert_eq!(
            r.status,
            StatusCode::CREATED,
            "{}",
            String::from_utf8_lossy(&r.body)
        );
    }

    async fn key(&self, tenant: &str, scope: &str) -> CreatedKey {
        let body = format!(r#"{{"tenant":"{tenant}","scope":"{scope}"}}"#);
        let r = self.call(Method::POST, "/v1/keys", body).await;
        assert_eq!(
            r.status,
            StatusCode::CREATED,
            "{}",
            String::from_utf8_lossy(&r.body)
        );
        r.json()
    }

    async fn create_as(&self, key: &str) -> Sandbox {
        let r = self.call_as(key, Method::POST, "/v1/sandboxes", "{}").await;
        assert_eq!(
            r.status,
            StatusCode::CREATED,
            "{}",
            String::from_utf8_lossy(&r.body)
        );
        r.json()
    }
}

/// A 403's message, in either API's shape (E2B's paths answer `{code, message}`).
fn forbidden(r: &Reply, what: &str) -> String {
    assert_eq!(
        r.status,
        StatusCode::FORBIDDEN,
        "{what}: {}",
        String::from_utf8_lossy(&r.body)
    );
    let v: serde_json::Value = r.json();
    v["error"]["message"]
        .as_str()
        .or(v["message"].as_str())
        .unwrap_or_default()
        .to_owned()
}

/// Every route of both APIs with its path parameters filled in.
fn every_route(id: &str) -> Vec<(&'static str, &'static str, String)> {
    crate::ROUTES
        .iter()
        .chain(crate::e2b::control::ROUTES)
        .map(|(m, p)| {
            let uri = p
                .replace("{id}", id)
                .replace("{pid}", "1")
                .replace("{snap}", "abcdefghij0123456789")
                .replace("{name}", "base");
            (*m, *p, uri)
        })
        .collect()
}

#[tokio::test]
async fn another_tenants_sandbox_is_a_404_on_every_route() {
    let h = harness().await;
    h.tenant("team-a").await;
    h.tenant("team-b").await;
    let a = h.key("team-a", "tenant").await;
    let b = h.key("team-b", "tenant").await;
    let sb = h.create_as(&b.key).await;
    assert_eq!(sb.tenant, "team-b");
    let calls_before = h.node.calls.lock().unwrap().len();
    let mut tried = 0;
    for (method, route, uri) in every_route(&sb.id) {
        if access(method, route) != Access::Sandbox {
            continue;
        }
        let m: Method = method.parse().unwrap();
        let r = h.call_as(&a.key, m.clone(), &uri, "{}").await;
        assert_eq!(
            r.status,
            StatusCode::NOT_FOUND,
            "{method} {uri}: {}",
            String::from_utf8_lossy(&r.body)
        );
        // Exactly what a sandbox that does not exist answers.
        let missing = uri.replace(&sb.id, "zzzzzzzzzzzzzzzzzzzz");
        let r2 = h.call_as(&a.key, m, &missing, "{}").await;
        assert_eq!(r2.status, StatusCode::NOT_FOUND, "{method} {missing}");
        assert_eq!(
            String::from_utf8_lossy(&r.body).replace(&sb.id, "ID"),
            String::from_utf8_lossy(&r2.body).replace("zzzzzzzzzzzzzzzzzzzz", "ID"),
            "{method} {route}"
        );
        tried += 1;
    }
    assert!(tried >= 40, "only {tried} sandbox routes");
    // Not one of them reached the node.
    assert_eq!(h.node.calls.lock().unwrap().len(), calls_before);
    // B's own key still reaches it, and nothing of B's changed.
    let r = h
        .call_as(
            &b.key,
            Method::GET,
            &format!("/v1/sandboxes/{}", sb.id),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let got: Sandbox = r.json();
    assert_eq!(got.state, SandboxState::Running);
    assert!(
        !h.node
            .calls
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.starts_with("remove"))
    );
}

#[tokio::test]
async fn lists_show_a_tenant_its_own_sandboxes_and_an_admin_all() {
    let h = harness().await;
    h.tenant("team-a").await;
    h.tenant("team-b").await;
    let a = h.key("team-a", "tenant").await;
    let b = h.key("team-b", "read-only").await;
    let mine = h.create_as(&a.key).await;
    let other = h.create().await;
    assert_eq!(other.tenant, "default");
    let ids = |r: Reply| -> Vec<String> {
        let l: space_api::SandboxList = r.json();
        l.sandboxes.into_iter().map(|s| s.id).collect()
    };
    let r = h
        .call_as(&a.key, Method::GET, "/v1/sandboxes", Body::empty())
        .await;
    assert_eq!(ids(r), vec![mine.id.clone()]);
    let r = h
        .call_as(&b.key, Method::GET, "/v1/sandboxes", Body::empty())
        .await;
    assert!(ids(r).is_empty());
    let r = h.call(Method::GET, "/v1/sandboxes", Body::empty()).await;
    assert_eq!(ids(r).len(), 2);
    // E2B's lists too.
    let r = h
        .call_as(&a.key, Method::GET, "/v2/sandboxes", Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let v: Vec<serde_json::Value> = r.json();
    assert_eq!(v.len(), 1);
    assert_eq!(v[0]["sandboxID"], mine.id.as_str());
    // A fork belongs to its source's tenant.
    let r = h
        .call_as(
            &a.key,
            Method::POST,
            &format!("/v1/sandboxes/{}/fork", mine.id),
            "{}",
        )
        .await;
    assert_eq!(
        r.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let forks: space_api::SandboxList = r.json();
    assert_eq!(forks.sandboxes[0].tenant, "team-a");
    let r = h
        .call_as(&a.key, Method::GET, "/v1/sandboxes", Body::empty())
        .await;
    assert_eq!(ids(r).len(), 2);
    // The tenants' counts.
    let r = h.call(Method::GET, "/v1/tenants", Body::empty()).await;
    let l: TenantList = r.json();
    let t = |id: &str| l.tenants.iter().find(|t| t.id == id).unwrap().clone();
    assert_eq!((t("team-a").sandboxes, t("team-a").keys), (2, 1));
    assert_eq!((t("team-b").sandboxes, t("team-b").keys), (0, 1));
    assert_eq!(t("default").sandboxes, 1);
}

#[tokio::test]
async fn a_read_only_key_changes_nothing_and_admin_routes_need_an_admin() {
    let h = harness().await;
    h.tenant("team-a").await;
    let rw = h.key("team-a", "tenant").await;
    let ro = h.key("team-a", "read-only").await;
    let sb = h.create_as(&rw.key).await;
    let calls_before = h.node.calls.lock().unwrap().len();
    for (method, route, uri) in every_route(&sb.id) {
        let m: Method = method.parse().unwrap();
        if method == "GET" {
            continue;
        }
        let r = h.call_as(&ro.key, m, &uri, "{}").await;
        let msg = forbidden(&r, &uri);
        assert!(
            msg.contains("read-only") || msg.contains("admin"),
            "{method} {route}: {msg}"
        );
    }
    assert_eq!(
        h.node.calls.lock().unwrap().len(),
        calls_before,
        "a refused call reached the node"
    );
    // Its reads work.
    let r = h
        .call_as(
            &ro.key,
            Method::GET,
            &format!("/v1/sandboxes/{}", sb.id),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    // Admin routes refuse tenant keys, whatever they are; shared reads are open to them.
    let mut admin_routes = Vec::new();
    for (method, route, uri) in every_route(&sb.id) {
        if access(method, route) != Access::Admin || route == "/healthz" {
            continue;
        }
        let r = h
            .call_as(&rw.key, method.parse().unwrap(), &uri, "{}")
            .await;
        let msg = forbidden(&r, &uri);
        assert!(
            msg.contains("needs an admin key"),
            "{method} {route}: {msg}"
        );
        admin_routes.push(route);
    }
    for route in [
        "/metrics",
        "/v1/nodes",
        "/v1/cluster",
        "/v1/tenants",
        "/v1/keys",
        "/v1/sandboxes/{id}/migrate",
    ] {
        assert!(
            admin_routes.contains(&route),
            "{route} is not an admin route"
        );
    }
    let r = h
        .call_as(&rw.key, Method::GET, "/v1/templates", Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::OK);
}

const SECRET: &str =
    r#"{"value":"v-VALUE","hosts":["api.x.com"],"header":"Authorization: Bearer {}"}"#;

#[tokio::test]
async fn secrets_are_the_keys_own_tenants() {
    let h = harness().await;
    h.tenant("team-a").await;
    h.tenant("team-b").await;
    let a = h.key("team-a", "tenant").await;
    let b = h.key("team-b", "tenant").await;
    let put = |key: String, value: &'static str| {
        let h = &h;
        async move {
            h.call_as(
                &key,
                Method::PUT,
                "/v1/secrets/TOKEN",
                SECRET.replace("VALUE", value),
            )
            .await
        }
    };
    // The same name in two tenants is two secrets.
    let r = put(a.key.clone(), "a").await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let info: space_api::SecretInfo = r.json();
    assert_eq!(info.tenant, "team-a");
    let r = h
        .call(
            Method::PUT,
            "/v1/secrets/TOKEN",
            SECRET.replace("VALUE", "admin"),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let names = |r: Reply| -> Vec<(String, String)> {
        let l: space_api::SecretList = r.json();
        l.secrets.into_iter().map(|s| (s.tenant, s.name)).collect()
    };
    let list = |key: String| {
        let h = &h;
        async move {
            h.call_as(&key, Method::GET, "/v1/secrets", Body::empty())
                .await
        }
    };
    assert_eq!(
        names(list(a.key.clone()).await),
        [("team-a".into(), "TOKEN".into())]
    );
    assert!(names(list(b.key.clone()).await).is_empty());
    assert_eq!(
        names(list(h.key.clone()).await),
        [("default".into(), "TOKEN".into())]
    );
    // Another tenant's secret is one that does not exist, on every route of both APIs.
    for (m, uri) in [
        (Method::GET, "/v1/secrets/TOKEN"),
        (Method::DELETE, "/v1/secrets/TOKEN"),
        (Method::GET, "/secrets/TOKEN"),
        (Method::DELETE, "/secrets/TOKEN"),
    ] {
        let r = h.call_as(&b.key, m.clone(), uri, Body::empty()).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND, "{m} {uri}");
    }
    let r = h
        .call_as(&b.key, Method::POST, "/secrets/TOKEN", r#"{"value":"x"}"#)
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = h
        .call_as(&b.key, Method::GET, "/secrets", Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let page: Vec<serde_json::Value> = r.json();
    assert!(page.is_empty());
    // B cannot bind A's; A binds its own, and the node asks for A's value.
    let r = h
        .call_as(
            &b.key,
            Method::POST,
            "/v1/sandboxes",
            r#"{"secrets":["TOKEN"]}"#,
        )
        .await;
    let msg = r.error(400, "invalid_argument");
    assert_eq!(msg, "secret TOKEN not found");
    let r = h
        .call_as(
            &a.key,
            Method::POST,
            "/v1/sandboxes",
            r#"{"secrets":["TOKEN"]}"#,
        )
        .await;
    assert_eq!(
        r.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let sb: Sandbox = r.json();
    let row = h
        .state
        .engine
        .store
        .get_sandbox(&sb.id)
        .await
        .unwrap()
        .unwrap();
    let bindings = crate::net::node_bindings(&row.spec.secrets);
    assert_eq!(bindings[0].source_name(), "team-a/TOKEN");
    let source = h.state.engine.secret_source();
    assert_eq!(
        source.secret_value("team-a/TOKEN").await.as_deref(),
        Some("v-a")
    );
    assert_eq!(
        source.secret_value("TOKEN").await.as_deref(),
        Some("v-admin")
    );
    // Nothing of A's changed through B's calls.
    assert_eq!(names(list(a.key.clone()).await).len(), 1);
}

#[tokio::test]
async fn a_tenants_templates_are_its_own_and_shared_ones_read_only() {
    let h = harness().await;
    h.tenant("team-a").await;
    h.tenant("team-b").await;
    let a = h.key("team-a", "tenant").await;
    let b = h.key("team-b", "tenant").await;
    let listed = |r: Reply| -> Vec<(String, String, bool)> {
        let l: space_api::TemplateList = r.json();
        l.templates
            .into_iter()
            .map(|t| {
                assert!(t.path.is_none(), "a host path shown to a tenant: {t:?}");
                (t.name, t.tenant, t.shared)
            })
            .collect()
    };
    let list = |key: String| {
        let h = &h;
        async move {
            listed(
                h.call_as(&key, Method::GET, "/v1/templates", Body::empty())
                    .await,
            )
        }
    };
    // The operator's templates are shared, read-only.
    assert_eq!(
        list(a.key.clone()).await,
        [("base".into(), "default".into(), true)]
    );
    let r = h
        .call_as(&a.key, Method::PUT, "/v1/templates/base/settings", "{}")
        .await;
    let msg = r.error(403, "permission_denied");
    assert!(msg.contains("shared read-only"), "{msg}");
    let r = h
        .call_as(&a.key, Method::DELETE, "/v1/templates/base", Body::empty())
        .await;
    r.error(403, "permission_denied");
    // A tenant's new names are TENANT.NAME.
    let r = h
        .call_as(&a.key, Method::PUT, "/v1/templates/py", "tar")
        .await;
    let msg = r.error(403, "permission_denied");
    assert!(msg.contains("team-a.NAME"), "{msg}");
    // Another tenant's name space is not found, whether or not the name is taken there.
    let r = h
        .call_as(&a.key, Method::PUT, "/v1/templates/team-b.py", "tar")
        .await;
    r.error(404, "not_found");
    let r = h
        .call_as(&a.key, Method::PUT, "/v1/templates/team-a.py", "tar")
        .await;
    assert_eq!(
        r.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let t: space_api::Template = r.json();
    assert_eq!((t.tenant.as_str(), t.shared), ("team-a", false));
    // Private: B neither sees it nor creates from it, and its writes are 404s.
    assert_eq!(list(b.key.clone()).await.len(), 1);
    let missing = |uri: &str, method: Method, key: &str| {
        let (h, uri, key) = (&h, uri.to_owned(), key.to_owned());
        async move {
            let r = h.call_as(&key, method.clone(), &uri, "{}").await;
            let other = uri.replace("team-a.py", "team-a.zz");
            let r2 = h.call_as(&key, method, &other, "{}").await;
            (r.status, r2.status)
        }
    };
    for (m, uri) in [
        (Method::GET, "/v1/templates/team-a.py"),
        (Method::DELETE, "/v1/templates/team-a.py"),
        (Method::PUT, "/v1/templates/team-a.py/settings"),
        (Method::PUT, "/v1/templates/team-a.py/start"),
        (Method::POST, "/v1/templates/team-a.py/pull"),
        (Method::POST, "/v1/templates/team-a.py/build"),
        (Method::POST, "/v1/templates/team-a.py/from-snapshot"),
    ] {
        let (got, absent) = missing(uri, m.clone(), &b.key).await;
        assert_eq!(
            (got, absent),
            (StatusCode::NOT_FOUND, StatusCode::NOT_FOUND),
            "{m} {uri}"
        );
    }
    let r = h
        .call_as(
            &b.key,
            Method::POST,
            "/v1/sandboxes",
            r#"{"template":"team-a.py"}"#,
        )
        .await;
    let msg = r.error(404, "not_found");
    assert_eq!(msg, "template team-a.py not found");
    // A uses it; the default tenant's sandboxes cannot either while it is private.
    let r = h
        .call_as(
            &a.key,
            Method::POST,
            "/v1/sandboxes",
            r#"{"template":"team-a.py"}"#,
        )
        .await;
    assert_eq!(
        r.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let r = h
        .call(Method::POST, "/v1/sandboxes", r#"{"template":"team-a.py"}"#)
        .await;
    r.error(404, "not_found");
    // Shared by its tenant: B sees it and creates from it, and still cannot change it.
    let r = h
        .call_as(
            &a.key,
            Method::PUT,
            "/v1/templates/team-a.py/settings",
            r#"{"shared":true}"#,
        )
        .await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    assert!(
        list(b.key.clone())
            .await
            .contains(&("team-a.py".into(), "team-a".into(), true))
    );
    let r = h
        .call_as(
            &b.key,
            Method::POST,
            "/v1/sandboxes",
            r#"{"template":"team-a.py"}"#,
        )
        .await;
    assert_eq!(
        r.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let r = h
        .call_as(
            &b.key,
            Method::DELETE,
            "/v1/templates/team-a.py",
            Body::empty(),
        )
        .await;
    r.error(403, "permission_denied");
    // A template from a snapshot of another tenant's sandbox: that sandbox is not found.
    let other = h.create_as(&b.key).await;
    let body = format!(
        r#"{{"sandbox":"{}","snapshot":"abcdefghij0123456789"}}"#,
        other.id
    );
    let r = h
        .call_as(
            &a.key,
            Method::POST,
            "/v1/templates/team-a.snap/from-snapshot",
            body,
        )
        .await;
    let msg = r.error(404, "not_found");
    assert_eq!(msg, format!("sandbox {} not found", other.id));
    // An operator's private template in a tenant's name space stays the operator's.
    let r = h.call(Method::PUT, "/v1/templates/team-b.ops", "tar").await;
    assert_eq!(r.status, StatusCode::CREATED);
    let r = h
        .call(
            Method::PUT,
            "/v1/templates/team-b.ops/settings",
            r#"{"shared":false}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = h
        .call_as(
            &b.key,
            Method::DELETE,
            "/v1/templates/team-b.ops",
            Body::empty(),
        )
        .await;
    r.error(404, "not_found");
    let l: space_api::TemplateList = h
        .call(Method::GET, "/v1/templates", Body::empty())
        .await
        .json();
    assert!(
        l.templates
            .iter()
            .any(|t| t.name == "team-b.ops" && t.tenant == "default")
    );
    // The admin sees every template, with its host path (the fake node keeps team-b.ops:
    // it cannot remove templates).
    let r = h.call(Method::GET, "/v1/templates", Body::empty()).await;
    let l: space_api::TemplateList = r.json();
    assert!(l.templates.iter().all(|t| t.path.is_some()));
    assert_eq!(l.templates.len(), 3);
}

#[tokio::test]
async fn a_pool_is_its_templates_tenants_and_its_members_are_charged_to_its_quota() {
    let h = harness().await;
    let r = h
        .call(
            Method::POST,
            "/v1/tenants",
            r#"{"id":"team-a","quota":{"sandboxes":3}}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    h.tenant("team-b").await;
    let a = h.key("team-a", "tenant").await;
    let b = h.key("team-b", "tenant").await;
    let ro = h.key("team-a", "read-only").await;
    let r = h
        .call_as(&a.key, Method::PUT, "/v1/templates/team-a.py", "tar")
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let pool = "/v1/templates/team-a.py/pool";
    // Over the quota with what it holds: nothing reaches the node.
    h.create_as(&a.key).await;
    let calls = h.node.calls.lock().unwrap().len();
    let msg = h
        .call_as(&a.key, Method::PUT, pool, r#"{"min":1,"max":3}"#)
        .await
        .error(403, "quota_exceeded");
    assert!(msg.contains("quota of 3 sandboxes"), "{msg}");
    assert_eq!(h.node.calls.lock().unwrap().len(), calls);
    // Within it, the pool is set, and its members count as the tenant's sandboxes.
    let r = h
        .call_as(&a.key, Method::PUT, pool, r#"{"min":1,"max":2}"#)
        .await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let msg = h
        .call_as(&a.key, Method::POST, "/v1/sandboxes", "{}")
        .await
        .error(403, "quota_exceeded");
    assert!(msg.contains("quota of 3 sandboxes"), "{msg}");
    // Resizing it checks the new size against the rest, not against itself.
    let r = h
        .call_as(&a.key, Method::PUT, pool, r#"{"min":1,"max":1}"#)
        .await;
    assert_eq!(r.status, StatusCode::OK);
    h.create_as(&a.key).await;
    // Its own key reads it (a read-only key too); the list shows its pools only.
    let r = h.call_as(&ro.key, Method::GET, pool, Body::empty()).await;
    assert_eq!(r.status, StatusCode::OK);
    let pools = |key: String| {
        let h = &h;
        async move {
            let l: space_api::PoolList = h
                .call_as(&key, Method::GET, "/v1/pools", Body::empty())
                .await
                .json();
            l.pools.into_iter().map(|p| p.template).collect::<Vec<_>>()
        }
    };
    h.call(Method::PUT, "/v1/templates/base/pool", r#"{"min":1}"#)
        .await;
    assert_eq!(pools(a.key.clone()).await, ["team-a.py"]);
    assert!(pools(b.key.clone()).await.is_empty());
    assert_eq!(pools(h.key.clone()).await, ["base", "team-a.py"]);
    // Another tenant: the private template's pool is not found, a shared one's is not its.
    for m in [Method::GET, Method::PUT] {
        h.call_as(&b.key, m.clone(), pool, r#"{"min":0}"#)
            .await
            .error(404, "not_found");
        let msg = h
            .call_as(&b.key, m, "/v1/templates/base/pool", r#"{"min":0}"#)
            .await
            .error(403, "permission_denied");
        assert!(msg.contains("tenant default's"), "{msg}");
    }
    // A name nobody has: the handler's own 404.
    h.call_as(
        &b.key,
        Method::GET,
        "/v1/templates/team-b.none/pool",
        Body::empty(),
    )
    .await
    .error(404, "not_found");
}

#[tokio::test]
async fn keys_rotate_with_an_overlap_and_a_revoked_key_fails_at_once() {
    let h = harness().await;
    h.tenant("team-a").await;
    let k = h.key("team-a", "tenant").await;
    assert_eq!(k.info.scope, space_api::tenant::KeyScope::Tenant);
    assert!(k.key.starts_with("sk_"));
    let ok = |key: &str| {
        let key = key.to_owned();
        let h = &h;
        async move {
            h.call_as(&key, Method::GET, "/v1/sandboxes", Body::empty())
                .await
                .status
        }
    };
    assert_eq!(ok(&k.key).await, StatusCode::OK);
    // Rotation with an overlap: both work; the old one says when it expires.
    let r = h
        .call(
            Method::POST,
            &format!("/v1/keys/{}/rotate", k.info.id),
            r#"{"overlap_secs":600}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let new: CreatedKey = r.json();
    assert_eq!(
        (new.info.tenant.as_str(), new.info.scope),
        ("team-a", k.info.scope)
    );
    assert_eq!(ok(&k.key).await, StatusCode::OK);
    assert_eq!(ok(&new.key).await, StatusCode::OK);
    let r = h
        .call(Method::GET, "/v1/keys?tenant=team-a", Body::empty())
        .await;
    let keys: ApiKeyList = r.json();
    let old: &ApiKey = keys.keys.iter().find(|x| x.id == k.info.id).unwrap();
    assert!(old.expires_at.is_some());
    assert!(!String::from_utf8_lossy(&r.body).contains(&k.key));
    // Rotation with no overlap: the old one fails at once.
    let r = h
        .call(
            Method::POST,
            &format!("/v1/keys/{}/rotate", new.info.id),
            r#"{"overlap_secs":0}"#,
        )
        .await;
    let newer: CreatedKey = r.json();
    assert_eq!(ok(&new.key).await, StatusCode::UNAUTHORIZED);
    assert_eq!(ok(&newer.key).await, StatusCode::OK);
    // Revocation: the next request fails.
    let r = h
        .call(
            Method::DELETE,
            &format!("/v1/keys/{}", newer.info.id),
            Body::empty(),
        )
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    assert_eq!(ok(&newer.key).await, StatusCode::UNAUTHORIZED);
    // Twice, or an unknown key.
    h.call(
        Method::DELETE,
        &format!("/v1/keys/{}", newer.info.id),
        Body::empty(),
    )
    .await
    .error(409, "conflict");
    h.call(Method::DELETE, "/v1/keys/nope", Body::empty())
        .await
        .error(404, "not_found");
    // The last admin key is kept.
    let r = h
        .call(Method::GET, "/v1/keys?tenant=default", Body::empty())
        .await;
    let admin = r.json::<ApiKeyList>().keys.remove(0);
    let msg = h
        .call(
            Method::DELETE,
            &format!("/v1/keys/{}", admin.id),
            Body::empty(),
        )
        .await
        .error(409, "conflict");
    assert!(msg.contains("last live admin key"), "{msg}");
    assert_eq!(ok(&h.key).await, StatusCode::OK);
}

#[tokio::test]
async fn bad_tenant_and_key_requests_get_clear_errors() {
    let h = harness().await;
    for (body, why) in [
        (r#"{"id":"Team"}"#, "invalid tenant id"),
        (r#"{"id":"-a"}"#, "invalid tenant id"),
        (r#"{}"#, "id"),
        (r#"{"id":"a","x":1}"#, "unknown field"),
    ] {
        let msg = h
            .call(Method::POST, "/v1/tenants", body)
            .await
            .error(400, "invalid_argument");
        assert!(msg.contains(why), "{body}: {msg}");
    }
    h.tenant("team-a").await;
    h.call(Method::POST, "/v1/tenants", r#"{"id":"team-a"}"#)
        .await
        .error(409, "conflict");
    for (body, status, why) in [
        (
            r#"{"tenant":"nope","scope":"tenant"}"#,
            404,
            "tenant nope not found",
        ),
        (
            r#"{"tenant":"team-a","scope":"root"}"#,
            400,
            "unknown variant",
        ),
        (
            r#"{"tenant":"team-a","scope":"admin"}"#,
            400,
            "admin keys belong to tenant default",
        ),
        (r#"{"tenant":"team-a"}"#, 400, "scope"),
    ] {
        let r = h.call(Method::POST, "/v1/keys", body).await;
        assert_eq!(r.status.as_u16(), status, "{body}");
        let e: ErrorBody = r.json();
        assert!(e.error.message.contains(why), "{body}: {}", e.error.message);
    }
    let big = format!(r#"{{"overlap_secs":{}}}"#, 8 * 24 * 3600);
    let k = h.key("team-a", "tenant").await;
    h.call(Method::POST, &format!("/v1/keys/{}/rotate", k.info.id), big)
        .await
        .error(400, "invalid_argument");
    // A tenant with sandboxes or keys stays; default always stays.
    let msg = h
        .call(Method::DELETE, "/v1/tenants/team-a", Body::empty())
        .await
        .error(409, "conflict");
    assert!(msg.contains("1 live keys"), "{msg}");
    h.call(Method::DELETE, "/v1/tenants/default", Body::empty())
        .await
        .error(409, "conflict");
    h.call(Method::DELETE, "/v1/tenants/nope", Body::empty())
        .await
        .error(404, "not_found");
    h.call(
        Method::DELETE,
        &format!("/v1/keys/{}", k.info.id),
        Body::empty(),
    )
    .await;
    let r = h
        .call(Method::DELETE, "/v1/tenants/team-a", Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let l: TenantList = h
        .call(Method::GET, "/v1/tenants", Body::empty())
        .await
        .json();
    assert!(l.tenants.iter().all(|t: &Tenant| t.id != "team-a"));
}

#[tokio::test]
async fn idempotency_keys_are_the_tenants_own() {
    let h = harness().await;
    h.tenant("team-a").await;
    h.tenant("team-b").await;
    let a = h.key("team-a", "tenant").await;
    let b = h.key("team-b", "tenant").await;
    let create = |key: String| {
        let h = &h;
        async move {
            let req = Request::builder()
                .method(Method::POST)
                .uri("/v1/sandboxes")
                .header("authorization", format!("Bearer {key}"))
                .header("content-type", "application/json")
                .header("idempotency-key", "same-key")
                .body(Body::from("{}"))
                .unwrap();
            let r = h.send(req).await;
            assert!(
                r.status.is_success(),
                "{}",
                String::from_utf8_lossy(&r.body)
            );
            r.json::<Sandbox>()
        }
    };
    let (sa, sb) = (create(a.key.clone()).await, create(b.key.clone()).await);
    assert_ne!(sa.id, sb.id);
    assert_eq!(
        (sa.tenant.as_str(), sb.tenant.as_str()),
        ("team-a", "team-b")
    );
    // Within a tenant it is still one sandbox per key.
    assert_eq!(create(a.key.clone()).await.id, sa.id);
}

/// What the key check and the ownership check cost per request, with the sandbox's tenant
/// cached: `cargo test -p space-control --release -- --ignored --nocapture bench_auth_and_ownership`.
#[tokio::test]
#[ignore = "benchmark; prints figures for BENCHMARKS.md"]
async fn bench_auth_and_ownership() {
    let h = harness().await;
    h.tenant("team-a").await;
    let a = h.key("team-a", "tenant").await;
    let sb = h.create_as(&a.key).await;
    // 100 more keys, as a deployment with many tenants' keys has (every one is compared).
    for i in 0..100 {
        h.tenant(&format!("t{i}")).await;
        h.key(&format!("t{i}"), "tenant").await;
    }
    let n: usize = std::env::var("SPACE_BENCH_N").map_or(20_000, |v| v.parse().unwrap());
    let path = format!("/v1/sandboxes/{}/exec", sb.id);
    let mut us = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = std::time::Instant::now();
        let who = h.state.auth.verify(&a.key).unwrap();
        crate::tenants::authorize(
            &h.state.engine,
            &who,
            &Method::POST,
            Some("/v1/sandboxes/{id}/exec"),
            &path,
        )
        .await
        .unwrap();
        us.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    us.sort_by(f64::total_cmp);
    let p = |q: f64| us[((us.len() as f64 - 1.0) * q) as usize];
    eprintln!(
        "key check + ownership check, {n} runs, 102 live keys: p50 {:.2} µs, p90 {:.2} µs, p99 {:.2} µs",
        p(0.5),
        p(0.9),
        p(0.99)
    );
}

/// What a quota adds to a create: the row's insert with the tenant's quota checked in its
/// transaction (lock the tenant, sum its sandboxes and pools, insert) against the plain
/// insert of a tenant without one, alternating, each tenant holding 20 sandboxes and one
/// pool (SQLite, as all-in-one spaced runs). Run with `--release`.
#[tokio::test]
#[ignore = "benchmark; prints figures for BENCHMARKS.md"]
async fn bench_quota_check() {
    let h = harness().await;
    let r = h
        .call(
            Method::POST,
            "/v1/tenants",
            r#"{"id":"quota","quota":{"sandboxes":100000,"cpu":100000,"memory_mib":100000000}}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    h.tenant("free").await;
    let engine = &h.state.engine;
    for t in ["quota", "free"] {
        let name = format!("{t}.py");
        engine.store.claim_template(&name, t).await.unwrap();
        engine
            .store
            .put_pool(&crate::pools::PoolRow {
                template: name,
                min: 1,
                max: 2,
                runtime: "namespace".into(),
                updated_at: 0,
            })
            .await
            .unwrap();
        for i in 0..20 {
            let mut row =
                crate::store::tests::row(&format!("{t:x<8}{i:012}"), SandboxState::Running, 1);
            row.tenant = t.into();
            engine.insert_sandbox_row(&row).await.unwrap();
        }
    }
    let n: usize = std::env::var("SPACE_BENCH_N").map_or(2_000, |v| v.parse().unwrap());
    let (mut with, mut without) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n {
        for t in if i % 2 == 0 {
            ["quota", "free"]
        } else {
            ["free", "quota"]
        } {
            let mut row =
                crate::store::tests::row("zzzzzzzzzzzzzzzzzzzz", SandboxState::Creating, 2);
            row.tenant = t.into();
            let t0 = std::time::Instant::now();
            engine.insert_sandbox_row(&row).await.unwrap();
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            if t == "quota" {
                with.push(ms)
            } else {
                without.push(ms)
            }
            engine.store.delete_sandbox(&row.id).await.unwrap();
        }
    }
    let p = |v: &mut Vec<f64>, q: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() as f64 - 1.0) * q) as usize]
    };
    for (what, v) in [("with a quota", &mut with), ("without", &mut without)] {
        eprintln!(
            "create's row insert {what}: p50 {:.3} ms, p90 {:.3} ms, p99 {:.3} ms ({n} runs)",
            p(v, 0.5),
            p(v, 0.9),
            p(v, 0.99)
        );
    }
    eprintln!(
        "the quota check's cost at p50: {:+.3} ms",
        p(&mut with, 0.5) - p(&mut without, 0.5)
    );
}

#[tokio::test]
async fn a_disk_quota_sums_the_sandboxes_disk_limits_and_gives_every_create_one() {
    let h = harness().await;
    let r = h
        .call(
            Method::POST,
            "/v1/tenants",
            r#"{"id":"team-d","quota":{"disk_mib":15000}}"#,
        )
        .await;
    assert_eq!(
        r.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let k = h.key("team-d", "tenant").await;
    let create = |body: &'static str| {
        let (h, key) = (&h, k.key.clone());
        async move { h.call_as(&key, Method::POST, "/v1/sandboxes", body).await }
    };
    let named: Sandbox = create(r#"{"disk_mib":4000}"#).await.json();
    assert_eq!(named.disk_mib, Some(4000));
    // A create that names no limit gets the default one, counted like any other.
    let r = create("{}").await;
    assert_eq!(
        r.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let given: Sandbox = r.json();
    assert_eq!(
        given.disk_mib,
        Some(space_api::tenant::DEFAULT_QUOTA_DISK_MIB)
    );
    let calls = h.node.calls.lock().unwrap().len();
    let msg = create(r#"{"disk_mib":1000}"#)
        .await
        .error(403, "quota_exceeded");
    assert!(msg.contains("disk quota of 15000 MiB"), "{msg}");
    assert!(msg.contains("14240 MiB claimed"), "{msg}");
    assert_eq!(
        h.node.calls.lock().unwrap().len(),
        calls,
        "a refused create reached the node"
    );
    // What is left fits; a fork claims its source's limit again.
    let r = create(r#"{"disk_mib":760}"#).await;
    assert_eq!(r.status, StatusCode::CREATED);
    let r = h
        .call_as(
            &k.key,
            Method::POST,
            &format!("/v1/sandboxes/{}/fork", named.id),
            "{}",
        )
        .await;
    r.error(403, "quota_exceeded");
    // The admin's tenant has no disk quota: no limit is added to its creates.
    let sb = h.create().await;
    assert_eq!(sb.disk_mib, None);
    // A quota smaller than the default gives the quota itself.
    let r = h
        .call(
            Method::PUT,
            "/v1/tenants/team-d",
            r#"{"quota":{"disk_mib":100000}}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    h.call(
        Method::POST,
        "/v1/tenants",
        r#"{"id":"team-s","quota":{"disk_mib":512}}"#,
    )
    .await;
    let s = h.key("team-s", "tenant").await;
    let sb: Sandbox = h
        .call_as(&s.key, Method::POST, "/v1/sandboxes", "{}")
        .await
        .json();
    assert_eq!(sb.disk_mib, Some(512));
    let l: TenantList = h
        .call(Method::GET, "/v1/tenants", Body::empty())
        .await
        .json();
    let q = l
        .tenants
        .iter()
        .find(|t| t.id == "team-s")
        .unwrap()
        .quota
        .clone();
    assert_eq!(q.unwrap().disk_mib, Some(512));
}

#[tokio::test]
async fn the_nodes_default_disk_limit_applies_where_no_tenant_quota_does() {
    let h = harness_with(|c| c.default_disk_mib = Some(2048)).await;
    let sb = h.create().await;
    assert_eq!(sb.disk_mib, Some(2048));
    let r = h
        .call(Method::POST, "/v1/sandboxes", r#"{"disk_mib":100}"#)
        .await;
    let named: Sandbox = r.json();
    assert_eq!(named.disk_mib, Some(100), "a create's own limit wins");
    // A tenant's disk quota gives its own default.
    h.call(
        Method::POST,
        "/v1/tenants",
        r#"{"id":"team-d","quota":{"disk_mib":512}}"#,
    )
    .await;
    let k = h.key("team-d", "tenant").await;
    assert_eq!(h.create_as(&k.key).await.disk_mib, Some(512));
}

#[tokio::test]
async fn a_tenants_quota_refuses_what_it_has_no_room_for_and_names_it() {
    let h = harness().await;
    let r = h
        .call(
            Method::POST,
            "/v1/tenants",
            r#"{"id":"team-q","quota":{"sandboxes":2,"cpu":1.5,"memory_mib":1024,"snapshots":1}}"#,
        )
        .await;
    assert_eq!(
        r.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let t: Tenant = r.json();
    assert_eq!(t.quota.as_ref().unwrap().cpu, Some(1.5));
    let k = h.key("team-q", "tenant").await;
    let create = |body: &'static str| {
        let (h, key) = (&h, k.key.clone());
        async move { h.call_as(&key, Method::POST, "/v1/sandboxes", body).await }
    };
    let first: Sandbox = create(r#"{"cpu":1,"memory_mib":512}"#).await.json();
    let calls = h.node.calls.lock().unwrap().len();
    let msg = create(r#"{"cpu":1,"memory_mib":256}"#)
        .await
        .error(403, "quota_exceeded");
    assert!(msg.contains("CPU quota of 1.5 cores"), "{msg}");
    let msg = create(r#"{"cpu":0.5,"memory_mib":768}"#)
        .await
        .error(403, "quota_exceeded");
    assert!(msg.contains("memory quota of 1024 MiB"), "{msg}");
    assert_eq!(
        h.node.calls.lock().unwrap().len(),
        calls,
        "a refused create reached the node"
    );
    let second = create(r#"{"cpu":0.5,"memory_mib":256}"#).await;
    assert_eq!(second.status, StatusCode::CREATED);
    let msg = create(r#"{"cpu":0.1,"memory_mib":64}"#)
        .await
        .error(403, "quota_exceeded");
    assert!(msg.contains("quota of 2 sandboxes"), "{msg}");
    // Snapshots: one fits, the second does not; a fork is a sandbox, over the quota too.
    let snap = format!("/v1/sandboxes/{}/snapshots", first.id);
    let r = h.call_as(&k.key, Method::POST, &snap, "{}").await;
    assert_eq!(
        r.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    let msg = h
        .call_as(&k.key, Method::POST, &snap, "{}")
        .await
        .error(403, "quota_exceeded");
    assert!(msg.contains("quota of 1 snapshots"), "{msg}");
    let r = h
        .call_as(
            &k.key,
            Method::POST,
            &format!("/v1/sandboxes/{}/fork", first.id),
            "{}",
        )
        .await;
    assert_eq!(
        r.status,
        StatusCode::FORBIDDEN,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
    // Other tenants are not affected.
    h.create().await;
    // Raised, it takes one more; the settings are replaced whole (no quota: no limit).
    let r = h
        .call(
            Method::PUT,
            "/v1/tenants/team-q",
            r#"{"quota":{"sandboxes":3}}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(create(r#"{"cpu":4}"#).await.status, StatusCode::CREATED);
    // Bad quotas.
    for body in [
        r#"{"quota":{"cpu":-1}}"#,
        r#"{"quota":{"cpu":0}}"#,
        r#"{"quota":{"sandboxes":-1}}"#,
        r#"{"quota":{"disk":1}}"#,
    ] {
        h.call(Method::PUT, "/v1/tenants/team-q", body)
            .await
            .error(400, "invalid_argument");
    }
    h.call(Method::PUT, "/v1/tenants/nope", "{}")
        .await
        .error(404, "not_found");
}

#[tokio::test]
async fn a_keys_rate_is_a_token_bucket_answering_429_with_retry_after() {
    let h = harness().await;
    h.tenant("team-a").await;
    let r = h
        .call(
            Method::POST,
            "/v1/keys",
            r#"{"tenant":"team-a","scope":"tenant","rate_per_sec":2}"#,
        )
        .await;
    let k: CreatedKey = r.json();
    assert_eq!(k.info.rate_per_sec, Some(2));
    // A burst of twice the rate, then 429.
    for i in 0..4 {
        let r = h
            .call_as(&k.key, Method::GET, "/v1/sandboxes", Body::empty())
            .await;
        assert_eq!(r.status, StatusCode::OK, "request {i}");
    }
    let req = Request::builder()
        .method(Method::GET)
        .uri("/v1/sandboxes")
        .header("authorization", format!("Bearer {}", k.key))
        .body(Body::empty())
        .unwrap();
    let resp = app(h.state.clone()).oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(resp.headers()["retry-after"], "1");
    let r = h
        .call_as(&k.key, Method::GET, "/v1/sandboxes", Body::empty())
        .await;
    let msg = r.error(429, "rate_limited");
    assert!(msg.contains("retry in"), "{msg}");
    // E2B's paths answer in E2B's shape.
    let r = h
        .call_as(&k.key, Method::GET, "/v2/sandboxes", Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    let v: serde_json::Value = r.json();
    assert_eq!(v["code"], 429);
    // Half a second later, one more.
    tokio::time::sleep(std::time::Duration::from_millis(550)).await;
    let r = h
        .call_as(&k.key, Method::GET, "/v1/sandboxes", Body::empty())
        .await;
    assert_eq!(r.status, StatusCode::OK);
    // The default for tenant keys is 100 a second; admin keys have none.
    let d = h.key("team-a", "read-only").await;
    assert_eq!(
        d.info.rate_per_sec,
        Some(space_api::tenant::DEFAULT_KEY_RATE)
    );
    for _ in 0..300 {
        let r = h.call(Method::GET, "/v1/sandboxes", Body::empty()).await;
        assert_eq!(r.status, StatusCode::OK);
    }
    h.call(
        Method::POST,
        "/v1/keys",
        r#"{"tenant":"team-a","scope":"tenant","rate_per_sec":0}"#,
    )
    .await
    .error(400, "invalid_argument");
}

#[tokio::test]
async fn the_platforms_own_environment_names_cannot_be_set() {
    let h = harness().await;
    let msg = h
        .call(
            Method::POST,
            "/v1/sandboxes",
            r#"{"env":{"SPACE_DEFAULT_USER":"root"}}"#,
        )
        .await
        .error(400, "invalid_argument");
    assert!(msg.contains("the platform's own"), "{msg}");
    let sb = h.create().await;
    let body = r#"{"cmd":["true"],"env":{"SPACE_CA_PEM":"x"}}"#;
    let msg = h
        .call(Method::POST, &format!("/v1/sandboxes/{}/exec", sb.id), body)
        .await
        .error(400, "invalid_argument");
    assert!(msg.contains("SPACE_CA_PEM"), "{msg}");
    // Others still pass.
    let body = r#"{"cmd":["true"],"env":{"MY_SPACE_VAR":"x"}}"#;
    let r = h
        .call(Method::POST, &format!("/v1/sandboxes/{}/exec", sb.id), body)
        .await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&r.body)
    );
}
