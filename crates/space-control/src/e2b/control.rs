//! E2B's control API over space's engine (decision 0022). Same paths, fields, status codes
//! and error bodies as E2B; what each call does to a sandbox's deadline:
//!
//! - **create** with `timeout` T (default 15 s, as E2B's API; the SDKs send 300): the
//!   deadline is now + T. At the deadline the sandbox is deleted, or paused with `autoPause`.
//! - **timeout** T: the deadline becomes now + T, shorter or longer, as on E2B.
//! - **connect** T: a running sandbox's deadline only ever moves later (never shortened,
//!   never silently reset); a paused one is resumed and gets at least now + T (300 s when no
//!   T is given).

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, delete, get, post, put};
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};
use space_api::{CreateSandbox, OnTimeout, Sandbox, SandboxState, SetTimeout};

use super::{E2bError, secrets};
use crate::AppState;
use crate::error::{ControlError, ErrorKind};
use crate::http::{ApiJson, ApiPath, ApiQuery};
use crate::tenants::Principal;

pub(super) type E2bResult<T> = Result<T, E2bError>;

/// E2B's control routes: (method, path). `http::app` registers them beside `/v1`.
pub const ROUTES: &[(&str, &str)] = &[
    ("POST", "/sandboxes"),
    ("GET", "/sandboxes"),
    ("POST", "/v2/sandboxes"),
    ("GET", "/v2/sandboxes"),
    ("GET", "/sandboxes/{id}"),
    ("DELETE", "/sandboxes/{id}"),
    ("POST", "/sandboxes/{id}/timeout"),
    ("GET", "/sandboxes/{id}/metrics"),
    ("POST", "/sandboxes/{id}/connect"),
    ("POST", "/v2/sandboxes/{id}/connect"),
    ("POST", "/sandboxes/{id}/pause"),
    ("POST", "/sandboxes/{id}/resume"),
    ("PUT", "/sandboxes/{id}/network"),
    ("POST", "/sandboxes/{id}/fork"),
    ("POST", "/sandboxes/{id}/snapshots"),
    ("GET", "/snapshots"),
    ("DELETE", "/templates/{id}"),
    ("POST", "/secrets"),
    ("GET", "/secrets"),
    ("GET", "/secrets/{id}"),
    ("POST", "/secrets/{id}"),
    ("DELETE", "/secrets/{id}"),
];

pub fn handler(method: &str, path: &str) -> MethodRouter<AppState> {
    match (method, path) {
        ("POST", "/sandboxes" | "/v2/sandboxes") => post(create),
        ("GET", "/sandboxes") => get(list_running),
        ("GET", "/v2/sandboxes") => get(list),
        ("GET", "/sandboxes/{id}") => get(info),
        ("DELETE", "/sandboxes/{id}") => delete(kill),
        ("POST", "/sandboxes/{id}/timeout") => post(set_timeout),
        ("GET", "/sandboxes/{id}/metrics") => get(metrics),
        ("POST", "/sandboxes/{id}/connect" | "/v2/sandboxes/{id}/connect") => post(connect),
        ("POST", "/sandboxes/{id}/pause") => post(pause),
        ("POST", "/sandboxes/{id}/resume") => post(resume),
        ("PUT", "/sandboxes/{id}/network") => put(update_network),
        ("POST", "/sandboxes/{id}/fork") => post(fork),
        ("POST", "/sandboxes/{id}/snapshots") => post(create_snapshot),
        ("GET", "/snapshots") => get(list_snapshots),
        ("DELETE", "/templates/{id}") => delete(delete_snapshot),
        ("POST", "/secrets") => post(secrets::create),
        ("GET", "/secrets") => get(secrets::list),
        ("GET", "/secrets/{id}") => get(secrets::get),
        ("POST", "/secrets/{id}") => post(secrets::update),
        ("DELETE", "/secrets/{id}") => delete(secrets::delete),
        _ => unreachable!("E2B route {method} {path} has no handler"),
    }
}

/// E2B's create timeout when none is given (its API's default).
const DEFAULT_CREATE_TIMEOUT_SECS: u64 = 15;
/// The deadline a connect gives a sandbox it resumes when it names no timeout.
const DEFAULT_CONNECT_TIMEOUT_SECS: u64 = 300;
/// Largest page of a list.
pub(super) const MAX_PAGE: usize = 100;
/// `clientID`: the node that runs the sandbox (one all-in-one node).
const CLIENT_ID: &str = "space";
/// `endAt` of a sandbox that has no deadline.
const NO_DEADLINE: &str = "9999-12-31T23:59:59Z";

/// `NewSandbox` (POST /sandboxes) and `NewSandboxV2` (POST /v2/sandboxes). Unknown fields are
/// ignored, as E2B's API does; known features space does not serve are refused by name.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<u64>,
    #[serde(default)]
    auto_pause: bool,
    /// With `autoPause`: `false` makes the timeout's pause filesystem-only (a stop).
    auto_pause_memory: Option<bool>,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    network: Option<E2bNetwork>,
    mcp: Option<serde_json::Value>,
    volume_mounts: Option<serde_json::Value>,
    iam: Option<serde_json::Value>,
}

/// `Sandbox`: what create, connect and resume answer.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct E2bSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "clientID")]
    client_id: &'static str,
    envd_version: &'static str,
    envd_access_token: String,
    traffic_access_token: Option<String>,
    domain: Option<String>,
}

/// `SandboxDetail` (get) and `ListedSandbox` (list).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct E2bInfo {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "clientID")]
    client_id: &'static str,
    started_at: String,
    end_at: String,
    /// The sandbox's CPU limit rounded up to whole cores.
    cpu_count: u32,
    #[serde(rename = "memoryMB")]
    memory_mb: u64,
    /// 0: space has no per-sandbox disk limit (yet).
    #[serde(rename = "diskSizeMB")]
    disk_size_mb: u64,
    state: &'static str,
    envd_version: &'static str,
    metadata: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    envd_access_token: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    allow_internet_access: Option<bool>,
    domain: Option<String>,
}

/// E2B knows two states: a sandbox being deleted is gone, every other one runs or is paused.
/// A stopped sandbox (a filesystem-only pause, or an init that kept dying) is paused: a
/// connect starts it again from its filesystem, as E2B's resume of such a pause does.
fn e2b_state(s: SandboxState) -> Option<&'static str> {
    match s {
        SandboxState::Paused | SandboxState::Stopped => Some("paused"),
        SandboxState::Deleting => None,
        _ => Some("running"),
    }
}

fn sandbox_reply(s: &AppState, sb: &Sandbox) -> E2bSandbox {
    E2bSandbox {
        template_id: sb.template.clone(),
        sandbox_id: sb.id.clone(),
        client_id: CLIENT_ID,
        envd_version: super::ENVD_VERSION,
        envd_access_token: s.engine.ports.envd_token(&sb.id),
        traffic_access_token: Some(s.engine.ports.traffic_token(&sb.id)),
        domain: s.engine.config().e2b_domain.clone(),
    }
}

fn info_of(s: &AppState, sb: &Sandbox, token: Option<String>) -> E2bInfo {
    E2bInfo {
        template_id: sb.template.clone(),
        sandbox_id: sb.id.clone(),
        client_id: CLIENT_ID,
        started_at: sb.created_at.clone(),
        end_at: sb.timeout_at.clone().unwrap_or_else(|| NO_DEADLINE.into()),
        cpu_count: sb.cpu.ceil().max(1.0) as u32,
        memory_mb: sb.memory_mib,
        disk_size_mb: 0,
        state: e2b_state(sb.state).unwrap_or("running"),
        envd_version: super::ENVD_VERSION,
        metadata: sb.metadata.clone(),
        envd_access_token: token,
        allow_internet_access: sb
            .network
            .as_ref()
            .map(|n| n.egress != space_api::Egress::None),
        domain: s.engine.config().e2b_domain.clone(),
    }
}

/// A 400 in E2B's shape.
pub(super) fn invalid(message: impl Into<String>) -> E2bError {
    E2bError(ControlError::invalid(message))
}

/// Whether E2B sees the sandbox as paused (frozen, or stopped by a filesystem-only pause):
/// what pause refuses and connect or resume starts again.
fn paused(s: SandboxState) -> bool {
    e2b_state(s) == Some("paused")
}

/// [`not_found`], for the ownership check (another tenant's sandbox reads as missing).
pub(crate) fn sandbox_not_found(id: &str) -> E2bError {
    not_found(id)
}

/// A missing sandbox in E2B's words (the SDKs match "not found").
fn not_found(id: &str) -> E2bError {
    E2bError(ControlError::not_found(format!(
        "sandbox \"{id}\" not found"
    )))
}

/// The sandbox `id`, or E2B's 404 (also for a malformed id and one being deleted).
async fn load(s: &AppState, id: &str) -> E2bResult<Sandbox> {
    if !space_api::is_valid_sandbox_id(id) {
        return Err(not_found(id));
    }
    match s.engine.get_sandbox(id).await {
        Ok(sb) if e2b_state(sb.state).is_some() => Ok(sb),
        Ok(_) => Err(not_found(id)),
        Err(e) if e.kind == ErrorKind::NotFound => Err(not_found(id)),
        Err(e) => Err(e.into()),
    }
}

/// E2B's network settings (`SandboxNetworkConfig` at create, `SandboxNetworkUpdateConfig` on
/// `PUT /sandboxes/{id}/network`), as far as space's egress policy expresses them.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct E2bNetwork {
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    /// Only in the update, and snake_case there, as E2B's API has it.
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    /// Accepted and moot: space's port URLs always need their token.
    #[allow(dead_code)]
    allow_public_traffic: Option<bool>,
    dns_servers: Option<serde_json::Value>,
    egress_proxy: Option<serde_json::Value>,
    mask_request_host: Option<serde_json::Value>,
    https_ports: Option<serde_json::Value>,
    /// Headers with secrets in them, at create (see [`secrets::rule_headers`]).
    rules: Option<serde_json::Value>,
}

/// An `allowOut` entry as a space rule. E2B filters domains on HTTP (80) and TLS (443) only
/// and admits addresses and CIDRs on every port, so an address or CIDR without ports gets
/// `:*`; space's own rules default to 80 and 443 (decision 0047).
fn e2b_rule(rule: &str) -> String {
    let r = rule.trim();
    let address = !r.is_empty()
        && !r.contains(':')
        && r.bytes()
            .all(|b| b.is_ascii_digit() || b == b'.' || b == b'/');
    if address {
        format!("{r}:*")
    } else {
        r.to_owned()
    }
}

/// Whether a `denyOut` entry denies every destination.
fn denies_all(rule: &str) -> bool {
    matches!(rule.trim(), "0.0.0.0/0" | "::/0" | "*")
}

/// E2B's network settings as space's egress policy (decision 0022):
/// - nothing said: the node's default; `allow_internet_access: false`: no egress;
/// - `denyOut: ["0.0.0.0/0"]` (deny all) with `allowOut`: only what `allowOut` names (an
///   allowlist of IPs, CIDRs and host names, as E2B's allowOut takes);
/// - `allowOut` alone opens nothing more than open egress does, which it stays.
///
/// space has no deny rules: a `denyOut` of particular destinations is refused with a 400
/// that says so, as are the settings space has no counterpart for (DNS servers, ...).
/// `rules` are the caller's to read ([`secrets::rule_headers`]).
pub(crate) fn network_policy(
    n: &E2bNetwork,
    internet: Option<bool>,
) -> E2bResult<Option<space_api::NetworkPolicy>> {
    for (name, given) in [
        ("dnsServers", n.dns_servers.is_some()),
        ("egressProxy", n.egress_proxy.is_some()),
        ("maskRequestHost", n.mask_request_host.is_some()),
        ("httpsPorts", n.https_ports.is_some()),
    ] {
        if given {
            return Err(invalid(format!(
                "network.{name} is not supported by space's E2B API yet"
            )));
        }
    }
    let deny = n.deny_out.clone().unwrap_or_default();
    let allow = n.allow_out.clone().unwrap_or_default();
    if let Some(rule) = deny.iter().find(|r| !denies_all(r)) {
        return Err(invalid(format!(
            "denyOut {rule:?}: space cannot deny particular destinations; deny everything \
             (\"0.0.0.0/0\") and list what is allowed in allowOut"
        )));
    }
    let internet = n.allow_internet_access.or(internet);
    use space_api::Egress;
    let egress = if !deny.is_empty() || internet == Some(false) {
        if allow.is_empty() {
            Egress::None
        } else {
            Egress::Allowlist
        }
    } else if internet == Some(true) || !allow.is_empty() {
        Egress::Open
    } else {
        return Ok(None);
    };
    let allow = if egress == Egress::Allowlist {
        allow.iter().map(|r| e2b_rule(r)).collect()
    } else {
        Vec::new()
    };
    Ok(Some(space_api::NetworkPolicy {
        egress: Some(egress),
        allow,
    }))
}

/// What `create` checks of a body before it touches the engine (the `rest` fuzz target's way
/// in): refusals are errors, never panics.
pub(crate) fn check_new_sandbox(req: &NewSandbox) {
    let _ = refuse_unsupported(req);
    if let Some(n) = &req.network {
        let _ = network_policy(n, req.allow_internet_access);
        if let Some(rules) = &n.rules {
            let _ = secrets::rule_headers(rules);
        }
    }
}

fn refuse_unsupported(req: &NewSandbox) -> E2bResult<()> {
    for (name, given) in [
        ("mcp", req.mcp.as_ref().is_some_and(|v| !v.is_null())),
        ("volumeMounts", req.volume_mounts.is_some()),
        ("iam", req.iam.is_some()),
    ] {
        if given {
            return Err(invalid(format!(
                "{name} is not supported by space's E2B API yet"
            )));
        }
    }
    Ok(())
}

/// The code interpreter SDK's default template, and space's name for it (decision 0025).
const E2B_CODE_INTERPRETER: &str = "code-interpreter-v1";
const CODE_INTERPRETER: &str = "code-interpreter";

/// The template a create names, where E2B's name for the code interpreter template means
/// space's `code-interpreter` unless the node has a template of E2B's name.
async fn template_of(s: &AppState, name: String) -> String {
    if name == E2B_CODE_INTERPRETER && s.engine.get_template(&name).await.is_err() {
        return CODE_INTERPRETER.to_owned();
    }
    name
}

async fn create(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiJson(req): ApiJson<NewSandbox>,
) -> E2bResult<Response> {
    refuse_unsupported(&req)?;
    let template = template_of(&s, req.template_id).await;
    let network = network_policy(
        req.network.as_ref().unwrap_or(&E2bNetwork::default()),
        req.allow_internet_access,
    )?;
    let secret_headers = match req.network.as_ref().and_then(|n| n.rules.as_ref()) {
        Some(rules) => secrets::rule_headers(rules)?,
        None => Vec::new(),
    };
    let create = CreateSandbox {
        template: Some(template),
        env: req.env_vars.unwrap_or_default(),
        metadata: req.metadata.unwrap_or_default(),
        timeout_secs: Some(req.timeout.unwrap_or(DEFAULT_CREATE_TIMEOUT_SECS)),
        on_timeout: Some(match (req.auto_pause, req.auto_pause_memory) {
            (true, Some(false)) => OnTimeout::Stop,
            (true, _) => OnTimeout::Pause,
            (false, _) => OnTimeout::Delete,
        }),
        network,
        secret_headers,
        ..Default::default()
    };
    let sb = s.engine.create_sandbox_for(&who.tenant, create).await?;
    Ok((StatusCode::CREATED, Json(sandbox_reply(&s, &sb))).into_response())
}

async fn info(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<crate::http::IdPath>,
) -> E2bResult<Json<E2bInfo>> {
    let sb = load(&s, &p.id).await?;
    let token = s.engine.ports.envd_token(&sb.id);
    Ok(Json(info_of(&s, &sb, Some(token))))
}

async fn kill(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<crate::http::IdPath>,
) -> E2bResult<StatusCode> {
    load(&s, &p.id).await?;
    match s.engine.delete_sandbox(&p.id).await {
        Ok(()) => Ok(StatusCode::NO_CONTENT),
        Err(e) if e.kind == ErrorKind::NotFound => Err(not_found(&p.id)),
        Err(e) => Err(e.into()),
    }
}

/// `GET /sandboxes/{id}/metrics?start=&end=` (unix seconds).
#[derive(Debug, Default, Deserialize)]
pub(crate) struct MetricsQuery {
    start: Option<i64>,
    end: Option<i64>,
}

/// E2B's `SandboxMetric`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct E2bMetric {
    timestamp: String,
    timestamp_unix: i64,
    cpu_count: u32,
    cpu_used_pct: f64,
    mem_used: u64,
    mem_total: u64,
    mem_cache: u64,
    disk_used: u64,
    disk_total: u64,
}

/// Every sample space keeps (decision 0024), in E2B's shape. The disk figures are the
/// current ones on every sample (the guest is asked once, at the call).
async fn metrics(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<crate::http::IdPath>,
    ApiQuery(q): ApiQuery<MetricsQuery>,
) -> E2bResult<Json<Vec<E2bMetric>>> {
    load(&s, &p.id).await?;
    let ms = |secs: Option<i64>| secs.map(|t| t.saturating_mul(1000));
    let m = s
        .engine
        .sandbox_metrics(&p.id, ms(q.start), ms(q.end).map(|e| e.saturating_add(999)))
        .await?;
    let cpu_count = m.cpu.ceil().max(1.0) as u32;
    Ok(Json(
        m.samples
            .into_iter()
            .map(|x| {
                let unix_ms = space_api::unix_ms_from_rfc3339(&x.time).unwrap_or(0);
                E2bMetric {
                    timestamp: x.time,
                    timestamp_unix: unix_ms.div_euclid(1000),
                    cpu_count,
                    cpu_used_pct: x.cpu_pct,
                    mem_used: x.memory_bytes,
                    mem_total: m.memory_limit_bytes,
                    mem_cache: x.memory_cache_bytes,
                    disk_used: m.disk_used_bytes.unwrap_or(0),
                    disk_total: m.disk_total_bytes.unwrap_or(0),
                }
            })
            .collect(),
    ))
}

#[derive(Debug, Deserialize)]
pub(crate) struct TimeoutBody {
    timeout: u64,
}

async fn set_timeout(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<crate::http::IdPath>,
    ApiJson(req): ApiJson<TimeoutBody>,
) -> E2bResult<StatusCode> {
    load(&s, &p.id).await?;
    s.engine
        .set_timeout(
            &p.id,
            SetTimeout {
                timeout_secs: Some(req.timeout),
                on_timeout: None,
            },
        )
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
struct ConnectBody {
    timeout: Option<u64>,
}

/// An optional JSON body: none, or empty, is `T::default()`.
fn optional_body<T: Default + serde::de::DeserializeOwned>(body: &[u8]) -> E2bResult<T> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| invalid(format!("invalid JSON body: {e}")))
}

/// Connect: resume a paused sandbox (201), or extend a running one's deadline (200).
async fn connect(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<crate::http::IdPath>,
    body: axum::body::Bytes,
) -> E2bResult<Response> {
    let req: ConnectBody = optional_body(&body)?;
    let sb = load(&s, &p.id).await?;
    let resumed = paused(sb.state);
    if resumed {
        match s.engine.resume_sandbox(&p.id).await {
            Ok(_) => {}
            // Resumed by someone else meanwhile: connect to it as it runs.
            Err(e) if e.kind == ErrorKind::Conflict => {}
            Err(e) => return Err(e.into()),
        }
    }
    let secs = req
        .timeout
        .or(resumed.then_some(DEFAULT_CONNECT_TIMEOUT_SECS));
    if let Some(secs) = secs {
        s.engine.extend_timeout(&p.id, secs, resumed).await?;
    }
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(sandbox_reply(&s, &sb))).into_response())
}

#[derive(Debug, Default, Deserialize)]
struct PauseBody {
    memory: Option<bool>,
}

async fn pause(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<crate::http::IdPath>,
    body: axum::body::Bytes,
) -> E2bResult<StatusCode> {
    let req: PauseBody = optional_body(&body)?;
    let sb = load(&s, &p.id).await?;
    if paused(sb.state) {
        return Err(E2bError(ControlError::conflict(format!(
            "sandbox \"{}\" is already paused",
            p.id
        ))));
    }
    if req.memory == Some(false) {
        s.engine.stop_sandbox(&p.id).await?;
    } else {
        s.engine.pause_sandbox(&p.id).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

/// The older SDKs' resume: 201 with the sandbox, 409 when it runs already.
async fn resume(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<crate::http::IdPath>,
    body: axum::body::Bytes,
) -> E2bResult<Response> {
    let req: ConnectBody = optional_body(&body)?;
    let sb = load(&s, &p.id).await?;
    if !paused(sb.state) {
        return Err(E2bError(ControlError::conflict(format!(
            "sandbox \"{}\" is already running",
            p.id
        ))));
    }
    s.engine.resume_sandbox(&p.id).await?;
    let secs = req.timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT_SECS);
    s.engine.extend_timeout(&p.id, secs, true).await?;
    Ok((StatusCode::CREATED, Json(sandbox_reply(&s, &sb))).into_response())
}

/// `PUT /sandboxes/{id}/network`: the policy replaced (see [`network_policy`]); 204.
async fn update_network(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<crate::http::IdPath>,
    ApiJson(req): ApiJson<E2bNetwork>,
) -> E2bResult<StatusCode> {
    load(&s, &p.id).await?;
    if req.rules.is_some() {
        return Err(invalid(
            "network.rules are set when a sandbox is created; space cannot change them later",
        ));
    }
    let policy = network_policy(&req, None)?.unwrap_or(space_api::NetworkPolicy {
        egress: None,
        allow: Vec::new(),
    });
    s.engine.set_network(&p.id, policy).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
struct ForkBody {
    timeout: Option<u64>,
    count: Option<u32>,
}

/// E2B's fork timeout when none is given (its API's default).
const DEFAULT_FORK_TIMEOUT_SECS: u64 = 15;

/// `POST /sandboxes/{id}/fork`: `count` new sandboxes from the sandbox as it is now (space's
/// fork: a snapshot, then one sandbox per copy; a running microvm's processes and memory
/// come along, a namespace sandbox's processes start fresh). Each gets a deadline of now +
/// `timeout` with the parent's timeout action. 201 with one `{"sandbox"}` per fork.
async fn fork(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<crate::http::IdPath>,
    body: axum::body::Bytes,
) -> E2bResult<Response> {
    let req: ForkBody = optional_body(&body)?;
    let parent = load(&s, &p.id).await?;
    let forks = s
        .engine
        .fork(
            &p.id,
            space_api::ForkRequest {
                snapshot: None,
                count: Some(req.count.unwrap_or(1)),
            },
        )
        .await?;
    let secs = req.timeout.unwrap_or(DEFAULT_FORK_TIMEOUT_SECS);
    let mut out = Vec::with_capacity(forks.len());
    for f in &forks {
        let timeout = SetTimeout {
            timeout_secs: Some(secs),
            on_timeout: Some(parent.on_timeout.unwrap_or(OnTimeout::Delete)),
        };
        out.push(match s.engine.set_timeout(&f.id, timeout).await {
            Ok(_) => serde_json::json!({"sandbox": sandbox_reply(&s, f)}),
            Err(e) => serde_json::json!({
                "error": {"code": e.http_status().as_u16(), "message": e.message},
            }),
        });
    }
    Ok((StatusCode::CREATED, Json(out)).into_response())
}

// ---- snapshots ----

/// E2B's snapshot is a template that new sandboxes start from: here a space snapshot of the
/// sandbox's filesystem, made a template (`POST /v1/templates/{name}/from-snapshot`). Its id
/// is the template's name: `name` when given, else `snapshot-<snapshot id>`.
#[derive(Debug, Default, Deserialize)]
struct SnapshotBody {
    name: Option<String>,
    memory: Option<bool>,
}

#[derive(Debug, Serialize)]
struct SnapshotInfo {
    #[serde(rename = "snapshotID")]
    snapshot_id: String,
    names: Vec<String>,
}

/// The template source of a snapshot template (`snapshot:<sandbox>/<snapshot>`).
const SNAPSHOT_SOURCE: &str = "snapshot:";

/// A tenant's name for a snapshot template: `NAME` as it is for `default`, else
/// `TENANT.NAME` (a tenant's templates are named so, decision 0048) unless it is already.
fn snapshot_name(tenant: &str, name: String) -> String {
    if tenant == space_api::tenant::DEFAULT_TENANT
        || name
            .strip_prefix(tenant)
            .is_some_and(|r| r.starts_with('.'))
    {
        name
    } else {
        format!("{tenant}.{name}")
    }
}

/// `POST /sandboxes/{id}/snapshots`: a snapshot of the sandbox's disk, kept as a template of
/// the sandbox's tenant (private to it unless it shares it).
async fn create_snapshot(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<crate::http::IdPath>,
    body: axum::body::Bytes,
) -> E2bResult<Response> {
    let req: SnapshotBody = optional_body(&body)?;
    if req.memory == Some(true) {
        return Err(invalid(
            "a snapshot with memory is not supported by space's E2B API yet: snapshots keep \
             the filesystem",
        ));
    }
    let row = load(&s, &p.id).await?;
    let tenant = row.tenant.clone();
    let claim = |name: String| {
        let (s, tenant) = (&s, &tenant);
        async move {
            let name = snapshot_name(tenant, name);
            crate::templates::check_template_name(&name)?;
            if tenant != space_api::tenant::DEFAULT_TENANT
                && s.engine.store.claim_template(&name, tenant).await? != *tenant
            {
                return Err(E2bError(ControlError::conflict(format!(
                    "the name {name} is taken"
                ))));
            }
            Ok::<_, E2bError>(name)
        }
    };
    let asked = match req.name {
        Some(n) => Some(claim(n).await?),
        None => None,
    };
    let snap = s
        .engine
        .create_snapshot(&p.id, space_api::CreateSnapshot::default())
        .await?;
    let name = match asked {
        Some(n) => n,
        None => claim(format!("snapshot-{}", snap.id)).await?,
    };
    let from = space_api::TemplateFromSnapshot {
        sandbox: p.id.clone(),
        snapshot: snap.id,
    };
    s.engine.template_from_snapshot(&name, from).await?;
    let info = SnapshotInfo {
        snapshot_id: name.clone(),
        names: vec![name],
    };
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SnapshotQuery {
    #[serde(rename = "sandboxID")]
    sandbox_id: Option<String>,
    name: Option<String>,
    limit: Option<usize>,
    next_token: Option<String>,
}

/// `GET /snapshots`: the snapshot templates, by name, in pages (`x-next-token`); a tenant
/// key's own only.
async fn list_snapshots(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiQuery(q): ApiQuery<SnapshotQuery>,
) -> E2bResult<Response> {
    let limit = q.limit.unwrap_or(MAX_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(invalid(format!(
            "limit must be between 1 and {MAX_PAGE}, got {limit}"
        )));
    }
    let mut names: Vec<String> = s
        .engine
        .list_templates(who.list_filter())
        .await?
        .into_iter()
        .filter(|t| {
            if !who.is_admin() && t.tenant != who.tenant {
                return false;
            }
            let Some(from) = t
                .source
                .as_deref()
                .and_then(|s| s.strip_prefix(SNAPSHOT_SOURCE))
            else {
                return false;
            };
            q.sandbox_id
                .as_deref()
                .is_none_or(|id| from.split('/').next() == Some(id))
                && q.name.as_deref().is_none_or(|n| n == t.name)
        })
        .map(|t| t.name)
        .collect();
    names.sort();
    names.dedup();
    let start = match &q.next_token {
        None => 0,
        Some(after) => names.iter().position(|n| n > after).unwrap_or(names.len()),
    };
    let page: Vec<String> = names[start..].iter().take(limit).cloned().collect();
    let next = (start + page.len() < names.len())
        .then(|| page.last().cloned())
        .flatten();
    let body: Vec<SnapshotInfo> = page
        .into_iter()
        .map(|n| SnapshotInfo {
            snapshot_id: n.clone(),
            names: vec![n],
        })
        .collect();
    Ok(page_reply(body, next))
}

/// `DELETE /templates/{id}` for a snapshot (204, or 404). Other templates are removed through
/// space's own API, so that an E2B call never removes `base` or an imported image.
async fn delete_snapshot(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<crate::http::IdPath>,
) -> E2bResult<StatusCode> {
    let template = s
        .engine
        .list_templates(None)
        .await?
        .into_iter()
        .find(|t| t.name == p.id);
    match template {
        None => Err(E2bError(ControlError::not_found(format!(
            "snapshot \"{}\" not found",
            p.id
        )))),
        Some(t)
            if !t
                .source
                .as_deref()
                .is_some_and(|s| s.starts_with(SNAPSHOT_SOURCE)) =>
        {
            Err(invalid(format!(
                "{} is a template, not a snapshot: remove it with DELETE /v1/templates/{}",
                p.id, p.id
            )))
        }
        Some(_) => {
            s.engine.remove_template(&p.id, None).await?;
            Ok(StatusCode::NO_CONTENT)
        }
    }
}

// ---- lists ----

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ListQuery {
    metadata: Option<String>,
    state: Option<String>,
    order: Option<String>,
    started_after: Option<String>,
    template: Option<String>,
    next_token: Option<String>,
    limit: Option<usize>,
}

/// The filters of a list, parsed.
struct Filter {
    metadata: Vec<(String, String)>,
    states: Vec<&'static str>,
    template: Option<String>,
    started_after_ms: Option<i64>,
}

impl Filter {
    fn parse(q: &ListQuery, default_states: &[&'static str]) -> E2bResult<Self> {
        let invalid = |m: String| invalid(m);
        let metadata = match &q.metadata {
            None => Vec::new(),
            Some(m) => {
                // `k=v&k2=v2`, each key and value percent-encoded once more by the SDKs.
                let pairs: Vec<(String, String)> = serde_urlencoded::from_str(m)
                    .map_err(|e| invalid(format!("invalid metadata filter {m:?}: {e}")))?;
                pairs
                    .into_iter()
                    .map(|(k, v)| {
                        (
                            crate::events::percent_decode(&k),
                            crate::events::percent_decode(&v),
                        )
                    })
                    .collect()
            }
        };
        let states = match &q.state {
            None => default_states.to_vec(),
            Some(list) => list
                .split(',')
                .map(|st| match st.trim() {
                    "running" => Ok("running"),
                    "paused" => Ok("paused"),
                    other => Err(invalid(format!(
                        "unknown state {other:?}: expected running or paused"
                    ))),
                })
                .collect::<Result<_, _>>()?,
        };
        let started_after_ms = match &q.started_after {
            None => None,
            Some(t) => Some(
                parse_time(t)
                    .ok_or_else(|| invalid(format!("invalid startedAfter {t:?}: RFC 3339")))?,
            ),
        };
        Ok(Self {
            metadata,
            states,
            template: q.template.clone(),
            started_after_ms,
        })
    }

    fn keeps(&self, sb: &Sandbox) -> bool {
        let Some(state) = e2b_state(sb.state) else {
            return false;
        };
        self.states.contains(&state)
            && self
                .metadata
                .iter()
                .all(|(k, v)| sb.metadata.get(k) == Some(v))
            && self.template.as_ref().is_none_or(|t| &sb.template == t)
            && self.started_after_ms.is_none_or(|after| {
                space_api::unix_ms_from_rfc3339(&sb.created_at).is_some_and(|at| at > after)
            })
    }
}

/// RFC 3339 with any fraction and a `Z` or `±HH:MM` offset (what the SDKs' `isoformat`
/// writes) to unix milliseconds.
fn parse_time(t: &str) -> Option<i64> {
    if t.len() < 20 || !t.is_char_boundary(19) {
        return None;
    }
    let (base, rest) = t.split_at(19);
    let (frac, offset) = match rest.find(['Z', '+', '-']) {
        Some(i) => rest.split_at(i),
        None => return None,
    };
    let millis = match frac.strip_prefix('.') {
        None if frac.is_empty() => 0,
        Some(digits) if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) => {
            format!("{digits:0<3}")[..3].parse::<i64>().ok()?
        }
        _ => return None,
    };
    let offset_ms = match offset {
        "Z" => 0,
        o => {
            let sign = if o.starts_with('-') { -1 } else { 1 };
            let (h, m) = o[1..].split_once(':')?;
            sign * (h.parse::<i64>().ok()? * 60 + m.parse::<i64>().ok()?) * 60_000
        }
    };
    Some(space_api::unix_ms_from_rfc3339(&format!("{base}Z"))? + millis - offset_ms)
}

/// The older SDKs' list: the running sandboxes, no pages.
async fn list_running(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> E2bResult<Json<Vec<E2bInfo>>> {
    let filter = Filter::parse(&q, &["running"])?;
    let list = s.engine.list_sandboxes(who.list_filter()).await?;
    Ok(Json(
        list.iter()
            .filter(|sb| filter.keeps(sb))
            .map(|sb| info_of(&s, sb, None))
            .collect(),
    ))
}

/// `GET /v2/sandboxes`: filtered, ordered by start (newest first unless `order=asc`), in
/// pages of `limit` (default and most 100) with `x-next-token` naming the next page.
async fn list(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> E2bResult<Response> {
    let filter = Filter::parse(&q, &["running", "paused"])?;
    let invalid = |m: String| invalid(m);
    let limit = q.limit.unwrap_or(MAX_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(invalid(format!(
            "limit must be between 1 and {MAX_PAGE}, got {limit}"
        )));
    }
    let desc = match q.order.as_deref() {
        None | Some("desc") => true,
        Some("asc") => false,
        Some(o) => return Err(invalid(format!("order must be asc or desc, got {o:?}"))),
    };
    let after = match &q.next_token {
        None => None,
        Some(t) => {
            Some(PageToken::parse(t).ok_or_else(|| invalid(format!("invalid nextToken {t:?}")))?)
        }
    };
    let mut list: Vec<(PageToken, Sandbox)> = s
        .engine
        .list_sandboxes(who.list_filter())
        .await?
        .into_iter()
        .filter(|sb| filter.keeps(sb))
        .map(|sb| (PageToken::of(&sb), sb))
        .collect();
    list.sort_by(|a, b| a.0.cmp(&b.0));
    if desc {
        list.reverse();
    }
    let start = match &after {
        None => 0,
        Some(t) => list
            .iter()
            .position(|(k, _)| if desc { k < t } else { k > t })
            .unwrap_or(list.len()),
    };
    let page: Vec<&(PageToken, Sandbox)> = list[start..].iter().take(limit).collect();
    let next = (start + page.len() < list.len())
        .then(|| page.last().map(|(k, _)| k.to_string()))
        .flatten();
    let body: Vec<E2bInfo> = page.iter().map(|(_, sb)| info_of(&s, sb, None)).collect();
    Ok(page_reply(body, next))
}

/// A page of a list, with `x-next-token` naming the next one when there is one.
pub(super) fn page_reply<T: Serialize>(page: Vec<T>, next: Option<String>) -> Response {
    let mut resp = Json(page).into_response();
    if let Some(v) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
        resp.headers_mut().insert("x-next-token", v);
    }
    resp
}

/// Where a page ends: the sandbox's start (unix ms) and id, as `<ms>_<id>`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct PageToken(i64, String);

impl PageToken {
    fn of(sb: &Sandbox) -> Self {
        Self(
            space_api::unix_ms_from_rfc3339(&sb.created_at).unwrap_or(0),
            sb.id.clone(),
        )
    }

    fn parse(t: &str) -> Option<Self> {
        let (ms, id) = t.split_once('_')?;
        space_api::is_valid_sandbox_id(id).then_some(())?;
        Some(Self(ms.parse().ok()?, id.to_string()))
    }
}

impl std::fmt::Display for PageToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}_{}", self.0, self.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(allow: &[&str], deny: &[&str]) -> E2bNetwork {
        let list = |v: &[&str]| Some(v.iter().map(|s| s.to_string()).collect());
        E2bNetwork {
            allow_out: list(allow),
            deny_out: list(deny),
            ..Default::default()
        }
    }

    #[test]
    fn e2b_network_settings_map_onto_egress_policies() {
        use space_api::Egress;
        let egress = |n: &E2bNetwork, i| network_policy(n, i).unwrap().map(|p| (p.egress, p.allow));
        assert_eq!(egress(&E2bNetwork::default(), None), None);
        assert_eq!(
            egress(&E2bNetwork::default(), Some(false)),
            Some((Some(Egress::None), vec![]))
        );
        assert_eq!(
            egress(
                &net(&["api.example.com", "10.0.0.0/8"], &["0.0.0.0/0"]),
                None
            ),
            Some((
                Some(Egress::Allowlist),
                vec!["api.example.com".to_string(), "10.0.0.0/8:*".to_string()]
            ))
        );
        assert_eq!(
            egress(&net(&[], &["0.0.0.0/0"]), None),
            Some((Some(Egress::None), vec![]))
        );
        assert_eq!(
            egress(&net(&["x.com"], &[]), None),
            Some((Some(Egress::Open), vec![]))
        );
        assert!(network_policy(&net(&[], &["1.2.3.4"]), None).is_err());
        let dns = E2bNetwork {
            dns_servers: Some(serde_json::json!(["1.1.1.1"])),
            ..Default::default()
        };
        assert!(network_policy(&dns, None).is_err());
    }

    #[test]
    fn times_parse_as_python_writes_them() {
        let z = space_api::unix_ms_from_rfc3339("2026-12-01T18:00:00Z").unwrap();
        assert_eq!(parse_time("2026-12-01T18:00:00Z"), Some(z));
        assert_eq!(parse_time("2026-12-01T18:00:00+00:00"), Some(z));
        assert_eq!(
            parse_time("2026-12-01T18:00:00.250000+00:00"),
            Some(z + 250)
        );
        assert_eq!(parse_time("2026-12-01T19:00:00+01:00"), Some(z));
        assert_eq!(parse_time("2026-12-01T17:30:00-00:30"), Some(z));
        assert_eq!(parse_time("2026-12-01 18:00:00"), None);
        assert_eq!(parse_time("yesterday"), None);
    }

    #[test]
    fn page_tokens_round_trip_and_order_by_start_then_id() {
        let a = PageToken(5, "a".repeat(20));
        let b = PageToken(5, "b".repeat(20));
        assert!(a < b && b < PageToken(6, "a".repeat(20)));
        assert_eq!(PageToken::parse(&a.to_string()), Some(a));
        assert_eq!(PageToken::parse("5_short"), None);
        assert_eq!(PageToken::parse("x_aaaaaaaaaaaaaaaaaaaa"), None);
    }
}
