//! The HTTP layer: routes, middleware (auth, tracing, audit), and one file per resource of
//! thin handlers (parse -> one engine call -> response). The extractors that turn every
//! rejection into the JSON error body are a leaf ([`extract`]): domain modules never import
//! this layer, it imports them.

mod console;
pub mod error;
mod extract;
mod files;
#[doc(hidden)]
pub mod fuzzing;
mod network;
mod nodes;
mod pools;
mod processes;
mod sandboxes;
mod secrets;
mod service;
mod snapshots;
mod templates;
mod tenants;
mod terminal;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{MethodRouter, any, delete, get, post, put};
use tracing::Instrument;

pub(crate) use extract::{ApiJson, ApiPath, ApiQuery, IdPath, NamePath, ndjson};

use crate::AppState;
use crate::error::{ControlError, ErrorCode};

/// Every route of the API: (method, path). `app()` registers exactly these, and a test
/// checks them against `api/openapi.yaml`.
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/healthz"),
    ("GET", "/metrics"),
    ("GET", "/v1/e2b"),
    ("POST", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes/{id}"),
    ("DELETE", "/v1/sandboxes/{id}"),
    ("POST", "/v1/sandboxes/{id}/pause"),
    ("POST", "/v1/sandboxes/{id}/migrate"),
    ("POST", "/v1/sandboxes/{id}/resume"),
    ("POST", "/v1/sandboxes/{id}/timeout"),
    ("PUT", "/v1/sandboxes/{id}/snapshot-policy"),
    ("POST", "/v1/sandboxes/{id}/exec"),
    ("GET", "/v1/sandboxes/{id}/processes"),
    ("GET", "/v1/sandboxes/{id}/processes/{pid}/output"),
    ("POST", "/v1/sandboxes/{id}/processes/{pid}/stdin"),
    ("POST", "/v1/sandboxes/{id}/processes/{pid}/stdin/close"),
    ("POST", "/v1/sandboxes/{id}/processes/{pid}/signal"),
    ("POST", "/v1/sandboxes/{id}/processes/{pid}/resize"),
    ("GET", "/v1/sandboxes/{id}/processes/{pid}/terminal"),
    ("GET", "/v1/sandboxes/{id}/files"),
    ("PUT", "/v1/sandboxes/{id}/files"),
    ("DELETE", "/v1/sandboxes/{id}/files"),
    ("GET", "/v1/sandboxes/{id}/files/stat"),
    ("GET", "/v1/sandboxes/{id}/files/watch"),
    ("GET", "/v1/sandboxes/{id}/files/list"),
    ("POST", "/v1/sandboxes/{id}/files/mkdir"),
    ("POST", "/v1/sandboxes/{id}/files/rename"),
    ("POST", "/v1/sandboxes/{id}/snapshots"),
    ("GET", "/v1/sandboxes/{id}/snapshots"),
    ("DELETE", "/v1/sandboxes/{id}/snapshots/{snap}"),
    ("POST", "/v1/sandboxes/{id}/rollback"),
    ("POST", "/v1/sandboxes/{id}/fork"),
    ("GET", "/v1/sandboxes/{id}/diff"),
    ("GET", "/v1/sandboxes/{id}/events"),
    ("GET", "/v1/sandboxes/{id}/metrics"),
    ("PUT", "/v1/sandboxes/{id}/network"),
    ("POST", "/v1/sandboxes/{id}/ports"),
    ("GET", "/v1/secrets"),
    ("GET", "/v1/secrets/{name}"),
    ("PUT", "/v1/secrets/{name}"),
    ("DELETE", "/v1/secrets/{name}"),
    ("GET", "/v1/templates"),
    ("PUT", "/v1/templates/{name}"),
    ("GET", "/v1/templates/{name}"),
    ("DELETE", "/v1/templates/{name}"),
    ("PUT", "/v1/templates/{name}/settings"),
    ("PUT", "/v1/templates/{name}/start"),
    ("POST", "/v1/templates/{name}/from-snapshot"),
    ("POST", "/v1/templates/{name}/pull"),
    ("POST", "/v1/templates/{name}/build"),
    ("GET", "/v1/templates/{name}/pool"),
    ("PUT", "/v1/templates/{name}/pool"),
    ("GET", "/v1/pools"),
    ("GET", "/v1/nodes"),
    ("POST", "/v1/nodes/tokens"),
    ("DELETE", "/v1/nodes/{id}"),
    ("POST", "/v1/nodes/{id}/drain"),
    ("DELETE", "/v1/nodes/{id}/drain"),
    ("GET", "/v1/cluster"),
    ("POST", "/v1/tenants"),
    ("GET", "/v1/tenants"),
    ("PUT", "/v1/tenants/{id}"),
    ("DELETE", "/v1/tenants/{id}"),
    ("POST", "/v1/keys"),
    ("GET", "/v1/keys"),
    ("POST", "/v1/keys/{id}/rotate"),
    ("DELETE", "/v1/keys/{id}"),
];

/// The handler of one entry of [`ROUTES`].
fn handler(method: &str, path: &str) -> MethodRouter<AppState> {
    match (method, path) {
        ("GET", "/healthz") => get(service::healthz),
        ("GET", "/metrics") => get(service::metrics),
        ("GET", "/v1/e2b") => get(service::e2b_settings),
        ("POST", "/v1/sandboxes") => post(sandboxes::create_sandbox),
        ("GET", "/v1/sandboxes") => get(sandboxes::list_sandboxes),
        ("GET", "/v1/sandboxes/{id}") => get(sandboxes::get_sandbox),
        ("DELETE", "/v1/sandboxes/{id}") => delete(sandboxes::delete_sandbox),
        ("POST", "/v1/sandboxes/{id}/pause") => post(sandboxes::pause),
        ("POST", "/v1/sandboxes/{id}/migrate") => post(nodes::migrate),
        ("POST", "/v1/sandboxes/{id}/resume") => post(sandboxes::resume),
        ("POST", "/v1/sandboxes/{id}/timeout") => post(sandboxes::set_timeout),
        ("PUT", "/v1/sandboxes/{id}/snapshot-policy") => put(sandboxes::set_snapshot_policy),
        ("POST", "/v1/sandboxes/{id}/exec") => post(processes::exec),
        ("GET", "/v1/sandboxes/{id}/processes") => get(processes::list_processes),
        ("GET", "/v1/sandboxes/{id}/processes/{pid}/output") => get(processes::process_output),
        ("POST", "/v1/sandboxes/{id}/processes/{pid}/stdin") => post(processes::write_stdin),
        ("POST", "/v1/sandboxes/{id}/processes/{pid}/stdin/close") => post(processes::close_stdin),
        ("POST", "/v1/sandboxes/{id}/processes/{pid}/signal") => post(processes::signal),
        ("POST", "/v1/sandboxes/{id}/processes/{pid}/resize") => post(processes::resize),
        ("GET", "/v1/sandboxes/{id}/processes/{pid}/terminal") => get(terminal::terminal),
        ("GET", "/v1/sandboxes/{id}/files") => get(files::read_file),
        ("PUT", "/v1/sandboxes/{id}/files") => put(files::write_file),
        ("DELETE", "/v1/sandboxes/{id}/files") => delete(files::remove_file),
        ("GET", "/v1/sandboxes/{id}/files/stat") => get(files::stat),
        ("GET", "/v1/sandboxes/{id}/files/watch") => get(files::watch_files),
        ("GET", "/v1/sandboxes/{id}/files/list") => get(files::list_dir),
        ("POST", "/v1/sandboxes/{id}/files/mkdir") => post(files::mkdir),
        ("POST", "/v1/sandboxes/{id}/files/rename") => post(files::rename),
        ("POST", "/v1/sandboxes/{id}/snapshots") => post(snapshots::create_snapshot),
        ("GET", "/v1/sandboxes/{id}/snapshots") => get(snapshots::list_snapshots),
        ("DELETE", "/v1/sandboxes/{id}/snapshots/{snap}") => delete(snapshots::delete_snapshot),
        ("POST", "/v1/sandboxes/{id}/rollback") => post(snapshots::rollback),
        ("POST", "/v1/sandboxes/{id}/fork") => post(snapshots::fork),
        ("GET", "/v1/sandboxes/{id}/diff") => get(snapshots::diff),
        ("GET", "/v1/sandboxes/{id}/events") => get(sandboxes::list_events),
        ("GET", "/v1/sandboxes/{id}/metrics") => get(sandboxes::metrics),
        ("PUT", "/v1/sandboxes/{id}/network") => put(network::set_network),
        ("POST", "/v1/sandboxes/{id}/ports") => post(network::open_port),
        ("GET", "/v1/secrets") => get(secrets::list_secrets),
        ("GET", "/v1/secrets/{name}") => get(secrets::get_secret),
        ("PUT", "/v1/secrets/{name}") => put(secrets::put_secret),
        ("DELETE", "/v1/secrets/{name}") => delete(secrets::delete_secret),
        ("GET", "/v1/templates") => get(templates::list_templates),
        ("PUT", "/v1/templates/{name}") => put(templates::import_template),
        ("GET", "/v1/templates/{name}") => get(templates::get_template),
        ("DELETE", "/v1/templates/{name}") => delete(templates::remove_template),
        ("PUT", "/v1/templates/{name}/settings") => put(templates::set_template_settings),
        ("PUT", "/v1/templates/{name}/start") => put(templates::set_template_start),
        ("POST", "/v1/templates/{name}/from-snapshot") => post(templates::template_from_snapshot),
        ("POST", "/v1/templates/{name}/pull") => post(templates::pull_template),
        ("POST", "/v1/templates/{name}/build") => post(templates::build_template),
        ("GET", "/v1/templates/{name}/pool") => get(pools::get_pool),
        ("PUT", "/v1/templates/{name}/pool") => put(pools::set_pool),
        ("GET", "/v1/pools") => get(pools::list_pools),
        ("GET", "/v1/nodes") => get(nodes::list_nodes),
        ("POST", "/v1/nodes/tokens") => post(nodes::create_token),
        ("DELETE", "/v1/nodes/{id}") => delete(nodes::remove_node),
        ("POST", "/v1/nodes/{id}/drain") => post(nodes::drain),
        ("DELETE", "/v1/nodes/{id}/drain") => delete(nodes::undrain),
        ("GET", "/v1/cluster") => get(nodes::cluster_status),
        ("POST", "/v1/tenants") => post(tenants::create_tenant),
        ("GET", "/v1/tenants") => get(tenants::list_tenants),
        ("PUT", "/v1/tenants/{id}") => put(tenants::set_tenant),
        ("DELETE", "/v1/tenants/{id}") => delete(tenants::delete_tenant),
        ("POST", "/v1/keys") => post(tenants::create_key),
        ("GET", "/v1/keys") => get(tenants::list_keys),
        ("POST", "/v1/keys/{id}/rotate") => post(tenants::rotate_key),
        ("DELETE", "/v1/keys/{id}") => delete(tenants::revoke_key),
        _ => unreachable!("route {method} {path} has no handler"),
    }
}

/// The router: every route in [`ROUTES`], JSON errors for unknown routes and methods, the
/// JSON body limit, auth and a tracing span per request.
pub fn app(state: AppState) -> Router {
    let mut router: Router<AppState> = Router::new();
    for (method, path) in ROUTES {
        router = router.route(path, handler(method, path));
    }
    for (method, path) in crate::e2b::control::ROUTES {
        router = router.route(path, crate::e2b::control::handler(method, path));
    }
    for path in crate::port_proxy::PROXY_ROUTER_PATHS {
        router = router.route(path, any(crate::port_proxy::proxy));
    }
    // The web console's files: public, outside the API (decision 0058).
    router = router
        .route(CONSOLE, get(console::root))
        .route("/ui/", get(console::root))
        .route("/ui/{*path}", get(console::asset));
    let json_limit = state.engine.config().max_json_bytes;
    router
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(json_limit))
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth))
        // envd's requests (E2b-Sandbox-Id) leave here for envd's router: no API key.
        .layer(axum::middleware::from_fn_with_state(
            crate::e2b::envd::Envd::new(state.clone()),
            crate::e2b::dispatch,
        ))
        // With --e2b-domain, `PORT-ID.DOMAIN` becomes the headers dispatch routes by.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::e2b::host::route,
        ))
        .layer(axum::middleware::from_fn_with_state(state.clone(), trace))
        .layer(axum::middleware::from_fn(close_after_unread_body))
        .with_state(state)
}

/// An error answered to a request that carried a body may leave part of that body unread
/// (413, a refused upload): hyper then closes the connection. Say so in the response, so a
/// client does not send its next request on a connection that is going away.
async fn close_after_unread_body(req: Request, next: Next) -> Response {
    let has_body = req.headers().contains_key(header::TRANSFER_ENCODING)
        || req
            .headers()
            .get(header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() != b"0");
    let mut resp = next.run(req).await;
    if has_body && (resp.status().is_client_error() || resp.status().is_server_error()) {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

async fn not_found(req: Request) -> ControlError {
    ControlError::not_found(format!(
        "no route for {} {}",
        req.method(),
        req.uri().path()
    ))
}

async fn method_not_allowed(req: Request) -> Response {
    error::response(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!(
            "method {} not allowed on {}",
            req.method(),
            req.uri().path()
        ),
    )
}

/// Where spaced serves the web console.
pub const CONSOLE: &str = "/ui";

/// API-key check ([`crate::auth::presented_key`]) on everything but `/healthz`, the port
/// proxy (`/p/...`, whose token is its credential) and the console's files (`/ui`, which hold
/// no data: every call the page makes carries its key), then who may do what
/// ([`crate::tenants::authorize`]); handlers find the [`crate::tenants::Principal`] in the
/// request's extensions.
async fn auth(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if path == "/healthz" || path.starts_with("/p/") || path == CONSOLE || path.starts_with("/ui/")
    {
        return next.run(req).await;
    }
    let Some((key, who)) = state
        .auth
        .verify_request_or_reload(&state.engine.store, req.headers())
        .await
    else {
        let err = ControlError::unauthorized(
            "missing or invalid API key (Authorization: Bearer <key>, X-API-KEY, or a \
             WebSocket's subprotocol space-key.<key>)",
        );
        return crate::tenants::refuse(req.uri().path(), err);
    };
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|m| m.as_str().to_owned());
    if let Err(refused) = crate::tenants::authorize(
        &state.engine,
        &who,
        req.method(),
        route.as_deref(),
        req.uri().path(),
    )
    .await
    {
        return refused;
    }
    if let Err(wait) = state.limiter.take(&who) {
        return crate::tenants::too_many_requests(req.uri().path(), wait);
    }
    let mut req = req;
    req.extensions_mut().insert(who);
    crate::events::audited(&state, &key, req, next).await
}

async fn trace(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let span = tracing::info_span!("request", method = %req.method(), path = %req.uri().path());
    let start = std::time::Instant::now();
    async move {
        let resp = next.run(req).await;
        let m = &state.engine.metrics;
        m.http_requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if resp.status().is_server_error() || resp.status().is_client_error() {
            let code = resp
                .extensions()
                .get::<ErrorCode>()
                .map_or("other", |c| c.0);
            m.http_error(code);
        }
        tracing::debug!(
            status = resp.status().as_u16(),
            elapsed_us = start.elapsed().as_micros() as u64,
            "done"
        );
        resp
    }
    .instrument(span)
    .await
}

type HResult<T> = Result<T, ControlError>;
