//! The HTTP layer: routes, extractors that turn every rejection into the JSON error body,
//! auth, and thin handlers (parse -> one engine call -> response).

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, FromRequestParts, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header, request::Parts};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, any, delete, get, post, put};
use axum::{Json, Router};
use futures::StreamExt;
use futures::stream::BoxStream;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use space_api::{
    EntryList, ExecRequest, Health, MakeDirRequest, OutputQuery, PathQuery, ProcessList,
    RenameRequest, ResizeRequest, SandboxList, SignalRequest, Started, TemplateList,
    WriteFileQuery,
};
use tracing::Instrument;

use crate::AppState;
use crate::engine::ExecReply;
use crate::error::{AppError, ErrorCode};

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
];

/// The handler of one entry of [`ROUTES`].
fn handler(method: &str, path: &str) -> MethodRouter<AppState> {
    match (method, path) {
        ("GET", "/healthz") => get(healthz),
        ("GET", "/metrics") => get(metrics),
        ("GET", "/v1/e2b") => get(e2b_settings),
        ("POST", "/v1/sandboxes") => post(create_sandbox),
        ("GET", "/v1/sandboxes") => get(list_sandboxes),
        ("GET", "/v1/sandboxes/{id}") => get(get_sandbox),
        ("DELETE", "/v1/sandboxes/{id}") => delete(delete_sandbox),
        ("POST", "/v1/sandboxes/{id}/pause") => post(crate::lifecycle::http_pause),
        ("POST", "/v1/sandboxes/{id}/resume") => post(crate::lifecycle::http_resume),
        ("POST", "/v1/sandboxes/{id}/timeout") => post(crate::lifecycle::http_set_timeout),
        ("PUT", "/v1/sandboxes/{id}/snapshot-policy") => {
            put(crate::snapshot_policy::http_set_policy)
        }
        ("POST", "/v1/sandboxes/{id}/exec") => post(exec),
        ("GET", "/v1/sandboxes/{id}/processes") => get(list_processes),
        ("GET", "/v1/sandboxes/{id}/processes/{pid}/output") => get(process_output),
        ("POST", "/v1/sandboxes/{id}/processes/{pid}/stdin") => post(write_stdin),
        ("POST", "/v1/sandboxes/{id}/processes/{pid}/stdin/close") => post(close_stdin),
        ("POST", "/v1/sandboxes/{id}/processes/{pid}/signal") => post(signal),
        ("POST", "/v1/sandboxes/{id}/processes/{pid}/resize") => post(resize),
        ("GET", "/v1/sandboxes/{id}/files") => get(read_file),
        ("PUT", "/v1/sandboxes/{id}/files") => put(write_file),
        ("DELETE", "/v1/sandboxes/{id}/files") => delete(remove_file),
        ("GET", "/v1/sandboxes/{id}/files/stat") => get(stat),
        ("GET", "/v1/sandboxes/{id}/files/watch") => get(watch_files),
        ("GET", "/v1/sandboxes/{id}/files/list") => get(list_dir),
        ("POST", "/v1/sandboxes/{id}/files/mkdir") => post(mkdir),
        ("POST", "/v1/sandboxes/{id}/files/rename") => post(rename),
        ("POST", "/v1/sandboxes/{id}/snapshots") => post(crate::snapshots::create_snapshot),
        ("GET", "/v1/sandboxes/{id}/snapshots") => get(crate::snapshots::list_snapshots),
        ("DELETE", "/v1/sandboxes/{id}/snapshots/{snap}") => {
            delete(crate::snapshots::delete_snapshot)
        }
        ("POST", "/v1/sandboxes/{id}/rollback") => post(crate::snapshots::rollback),
        ("POST", "/v1/sandboxes/{id}/fork") => post(crate::snapshots::fork),
        ("GET", "/v1/sandboxes/{id}/diff") => get(crate::diff::diff),
        ("GET", "/v1/sandboxes/{id}/events") => get(crate::events::http_list_events),
        ("GET", "/v1/sandboxes/{id}/metrics") => get(crate::usage::http_metrics),
        ("PUT", "/v1/sandboxes/{id}/network") => put(crate::net::http_set_network),
        ("POST", "/v1/sandboxes/{id}/ports") => post(crate::net::http_open_port),
        ("GET", "/v1/secrets") => get(crate::secrets::http_list),
        ("GET", "/v1/secrets/{name}") => get(crate::secrets::http_get),
        ("PUT", "/v1/secrets/{name}") => put(crate::secrets::http_put),
        ("DELETE", "/v1/secrets/{name}") => delete(crate::secrets::http_delete),
        ("GET", "/v1/templates") => get(list_templates),
        ("PUT", "/v1/templates/{name}") => put(import_template),
        ("GET", "/v1/templates/{name}") => get(crate::templates::get_template),
        ("DELETE", "/v1/templates/{name}") => delete(crate::templates::remove_template),
        ("PUT", "/v1/templates/{name}/settings") => put(crate::template_settings::http_set),
        ("PUT", "/v1/templates/{name}/start") => put(crate::templates::set_template_start),
        ("POST", "/v1/templates/{name}/from-snapshot") => {
            post(crate::snapshots::template_from_snapshot)
        }
        ("POST", "/v1/templates/{name}/pull") => post(crate::templates::pull_template),
        ("POST", "/v1/templates/{name}/build") => post(crate::build::build_template),
        ("GET", "/v1/templates/{name}/pool") => get(crate::pools::http_get),
        ("PUT", "/v1/templates/{name}/pool") => put(crate::pools::http_set),
        ("GET", "/v1/pools") => get(crate::pools::http_list),
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

async fn not_found(req: Request) -> AppError {
    AppError::not_found(format!(
        "no route for {} {}",
        req.method(),
        req.uri().path()
    ))
}

async fn method_not_allowed(req: Request) -> AppError {
    AppError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!(
            "method {} not allowed on {}",
            req.method(),
            req.uri().path()
        ),
    )
}

/// API-key check ([`crate::auth::presented_key`]) on everything but `/healthz` and the port proxy (`/p/...`, whose token
/// is its credential).
async fn auth(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if req.uri().path() == "/healthz" || req.uri().path().starts_with("/p/") {
        return next.run(req).await;
    }
    let Some(key) = state.auth.verify_request(req.headers()) else {
        let err = AppError::unauthorized(
            "missing or invalid API key (Authorization: Bearer <key>, or X-API-KEY)",
        );
        if crate::e2b::is_control_path(req.uri().path()) {
            return crate::e2b::E2bError(err).into_response();
        }
        return err.into_response();
    };
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

// ---- extractors: rejections become AppError (400/413 JSON) ----

/// A JSON body (any content type), limited by `DefaultBodyLimit`.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = AppError;

    async fn from_request(req: Request, state: &S) -> Result<Self, AppError> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(body_rejection)?;
        if bytes.is_empty() {
            return Err(AppError::invalid("a JSON request body is required"));
        }
        // serde would also accept a struct written as an array; the API takes objects only.
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(AppError::invalid("the request body must be a JSON object"));
        }
        serde_json::from_slice(&bytes)
            .map(ApiJson)
            .map_err(|e| AppError::invalid(format!("invalid JSON body: {e}")))
    }
}

/// A raw body (e.g. stdin bytes), limited by `DefaultBodyLimit`.
pub struct ApiBytes(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for ApiBytes {
    type Rejection = AppError;

    async fn from_request(req: Request, state: &S) -> Result<Self, AppError> {
        Bytes::from_request(req, state)
            .await
            .map(ApiBytes)
            .map_err(body_rejection)
    }
}

fn body_rejection(r: axum::extract::rejection::BytesRejection) -> AppError {
    if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        AppError::too_large("request body exceeds the size limit")
    } else {
        AppError::invalid(format!("cannot read the request body: {}", r.body_text()))
    }
}

/// Query parameters.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = AppError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, AppError> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| ApiQuery(q.0))
            .map_err(|r| AppError::invalid(format!("invalid query: {}", r.body_text())))
    }
}

/// Path parameters.
pub struct ApiPath<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for ApiPath<T> {
    type Rejection = AppError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, AppError> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| ApiPath(p.0))
            .map_err(|r| AppError::invalid(format!("invalid path: {}", r.body_text())))
    }
}

/// `{id}` of a route (one definition for every module's handlers).
#[derive(Debug, Deserialize)]
pub(crate) struct IdPath {
    pub(crate) id: String,
}

#[derive(Deserialize)]
struct PidPath {
    id: String,
    pid: u32,
}

#[derive(Deserialize)]
pub(crate) struct NamePath {
    pub(crate) name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PathOnly {
    path: String,
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// A stream of events (exec output, template progress) as an ndjson response.
pub(crate) fn ndjson<T: serde::Serialize + Send + 'static>(
    events: BoxStream<'static, T>,
) -> Response {
    let body = events.map(|ev| {
        let mut line = serde_json::to_vec(&ev).unwrap_or_default();
        line.push(b'\n');
        Ok::<_, Infallible>(Bytes::from(line))
    });
    (
        [
            (header::CONTENT_TYPE, "application/x-ndjson"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

type HResult<T> = Result<T, AppError>;

// ---- handlers ----

async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        version: env!("CARGO_PKG_VERSION").into(),
    })
}

async fn e2b_settings(State(s): State<AppState>) -> Json<space_api::E2bSettings> {
    let cfg = s.engine.config();
    Json(space_api::E2bSettings {
        domain: cfg.e2b_domain.clone(),
        ca: cfg.e2b_ca_pem.clone(),
    })
}

async fn metrics(State(s): State<AppState>) -> HResult<Response> {
    let text = s.engine.metrics_text().await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

async fn create_sandbox(
    State(s): State<AppState>,
    ApiJson(req): ApiJson<space_api::CreateSandbox>,
) -> HResult<Response> {
    let sb = s.engine.create_sandbox(req).await?;
    Ok((StatusCode::CREATED, Json(sb)).into_response())
}

async fn list_sandboxes(State(s): State<AppState>) -> HResult<Json<SandboxList>> {
    Ok(Json(SandboxList {
        sandboxes: s.engine.list_sandboxes().await?,
    }))
}

async fn get_sandbox(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
) -> HResult<Json<space_api::Sandbox>> {
    Ok(Json(s.engine.get_sandbox(&p.id).await?))
}

async fn delete_sandbox(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
) -> HResult<StatusCode> {
    s.engine.delete_sandbox(&p.id).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn exec(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiJson(req): ApiJson<ExecRequest>,
) -> HResult<Response> {
    Ok(match s.engine.exec(&p.id, req).await? {
        ExecReply::Events(events) => {
            ndjson(crate::snapshot_policy::after_exec(&s.engine, &p.id, events))
        }
        ExecReply::Background(pid) => (StatusCode::CREATED, Json(Started { pid })).into_response(),
    })
}

async fn list_processes(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
) -> HResult<Json<ProcessList>> {
    Ok(Json(ProcessList {
        processes: s.engine.list_processes(&p.id).await?,
    }))
}

async fn process_output(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<PidPath>,
    ApiQuery(q): ApiQuery<OutputQuery>,
) -> HResult<Response> {
    let events = s
        .engine
        .process_output(&p.id, p.pid, q.offset, q.follow.unwrap_or(true))
        .await?;
    Ok(ndjson(events))
}

async fn write_stdin(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<PidPath>,
    ApiBytes(body): ApiBytes,
) -> HResult<StatusCode> {
    s.engine.write_stdin(&p.id, p.pid, body).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn close_stdin(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<PidPath>,
) -> HResult<StatusCode> {
    s.engine.close_stdin(&p.id, p.pid).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn signal(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<PidPath>,
    ApiJson(req): ApiJson<SignalRequest>,
) -> HResult<StatusCode> {
    s.engine.signal(&p.id, p.pid, req).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn resize(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<PidPath>,
    ApiJson(req): ApiJson<ResizeRequest>,
) -> HResult<StatusCode> {
    s.engine.resize(&p.id, p.pid, req.rows, req.cols).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn read_file(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiQuery(q): ApiQuery<PathOnly>,
) -> HResult<Response> {
    let stream = s.engine.read_file(&p.id, &q.path).await?;
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Body::from_stream(stream),
    )
        .into_response())
}

async fn write_file(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiQuery(q): ApiQuery<WriteFileQuery>,
    headers: HeaderMap,
    body: Body,
) -> HResult<Json<space_api::EntryInfo>> {
    let entry = s
        .engine
        .write_file(
            &p.id,
            q,
            Default::default(),
            content_length(&headers),
            body.into_data_stream(),
        )
        .await?;
    Ok(Json(entry))
}

async fn remove_file(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> HResult<StatusCode> {
    s.engine.remove_file(&p.id, q).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn stat(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiQuery(q): ApiQuery<PathOnly>,
) -> HResult<Json<space_api::EntryInfo>> {
    Ok(Json(s.engine.stat(&p.id, &q.path).await?))
}

async fn watch_files(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiQuery(q): ApiQuery<space_api::WatchQuery>,
) -> HResult<Response> {
    Ok(ndjson(s.engine.watch(&p.id, &q.path, q.recursive).await?))
}

async fn list_dir(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> HResult<Json<EntryList>> {
    Ok(Json(EntryList {
        entries: s.engine.list_dir(&p.id, q).await?,
    }))
}

async fn mkdir(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiJson(req): ApiJson<MakeDirRequest>,
) -> HResult<Response> {
    let e = s.engine.mkdir(&p.id, req).await?;
    Ok((StatusCode::CREATED, Json(e)).into_response())
}

async fn rename(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiJson(req): ApiJson<RenameRequest>,
) -> HResult<Json<space_api::EntryInfo>> {
    Ok(Json(s.engine.rename(&p.id, req).await?))
}

async fn list_templates(State(s): State<AppState>) -> HResult<Json<TemplateList>> {
    Ok(Json(TemplateList {
        templates: s.engine.list_templates().await?,
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ImportQuery {
    #[serde(default)]
    replace: bool,
}

async fn import_template(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<NamePath>,
    ApiQuery(q): ApiQuery<ImportQuery>,
    headers: HeaderMap,
    body: Body,
) -> HResult<Response> {
    let t = s
        .engine
        .import_template(
            &p.name,
            q.replace,
            content_length(&headers),
            body.into_data_stream(),
        )
        .await?;
    Ok((StatusCode::CREATED, Json(t)).into_response())
}
