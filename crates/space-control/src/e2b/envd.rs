//! envd's API, served by spaced for every request that carries `E2b-Sandbox-Id`
//! (decision 0022). [`dispatch`] checks the sandbox and its access token and hands the
//! request to envd's own router; each call then goes over the sandbox's space-daemon channel
//! through the same engine methods as the native API.
//!
//! | envd | space |
//! |---|---|
//! | `GET /health` | the sandbox runs (204) |
//! | `process.Process/Start` | a foreground exec: start, data, keepalives, end |
//! | `Connect` | an attach to the process's output from its first byte |
//! | `List` | the running processes, with their tags |
//! | `SendInput`, `StreamInput`, `CloseStdin` | stdin writes and close |
//! | `SendSignal` | a signal to the process |
//! | `Update` | a PTY resize |
//!
//! A command's `Connect-Timeout-Ms` bounds its stream only: when it passes, the stream ends
//! with `deadline_exceeded` and the process keeps running (`Connect` reaches it again).

use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Extension, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine as _;
use futures::stream::{BoxStream, StreamExt};
use space_api::{ExecEvent, ExecRequest, SandboxState, SignalRequest, SignalSpec};
use tower::ServiceExt;

use super::connect::{self, Code, ConnectError};
use super::pb::process as pb;
use crate::AppState;
use crate::engine::ExecReply;

/// Who a call is for: the sandbox of `E2b-Sandbox-Id`, and the user of `Authorization:
/// Basic <user:>` (None: the template's default user, `user` on `base`).
#[derive(Debug, Clone)]
pub struct EnvdCtx {
    pub id: String,
    pub user: Option<String>,
}

/// What [`dispatch`] needs: the app's state and envd's router.
#[derive(Clone)]
pub struct Envd {
    state: AppState,
    router: Router,
}

impl Envd {
    pub fn new(state: AppState) -> Self {
        let router = Router::new()
            .route("/health", get(|| async { StatusCode::NO_CONTENT }))
            .route("/process.Process/Start", post(start))
            .route("/process.Process/Connect", post(connect_process))
            .route("/process.Process/List", post(list))
            .route("/process.Process/SendInput", post(send_input))
            .route("/process.Process/StreamInput", post(stream_input))
            .route("/process.Process/CloseStdin", post(close_stdin))
            .route("/process.Process/SendSignal", post(send_signal))
            .route("/process.Process/Update", post(update))
            .route("/filesystem.Filesystem/Stat", post(super::files::stat))
            .route(
                "/filesystem.Filesystem/MakeDir",
                post(super::files::make_dir),
            )
            .route(
                "/filesystem.Filesystem/Move",
                post(super::files::move_entry),
            )
            .route(
                "/filesystem.Filesystem/ListDir",
                post(super::files::list_dir),
            )
            .route("/filesystem.Filesystem/Remove", post(super::files::remove))
            .route(
                "/filesystem.Filesystem/WatchDir",
                post(super::watch::watch_dir),
            )
            .route(
                "/filesystem.Filesystem/CreateWatcher",
                post(super::watch::create_watcher),
            )
            .route(
                "/filesystem.Filesystem/GetWatcherEvents",
                post(super::watch::get_watcher_events),
            )
            .route(
                "/filesystem.Filesystem/RemoveWatcher",
                post(super::watch::remove_watcher),
            )
            .route(
                "/files",
                get(super::files::download)
                    .post(super::files::upload)
                    // The engine bounds uploads (--max-upload).
                    .layer(axum::extract::DefaultBodyLimit::disable()),
            )
            .fallback(unimplemented)
            .layer(Extension(std::sync::Arc::new(
                super::watch::Watchers::default(),
            )))
            .with_state(state.clone());
        Self { state, router }
    }
}

async fn unimplemented(req: Request) -> Response {
    ConnectError::new(
        Code::Unimplemented,
        format!("envd has no {} {} on space", req.method(), req.uri().path()),
    )
    .into_response()
}

/// The outermost middleware: a request with `E2b-Sandbox-Id` is envd's; any other goes on to
/// spaced's own routes.
pub async fn dispatch(State(envd): State<Envd>, req: Request, next: Next) -> Response {
    let Some(id) = req.headers().get(super::SANDBOX_ID_HEADER) else {
        return next.run(req).await;
    };
    let id = id.to_str().unwrap_or("").to_string();
    if let Some(port) = other_port(req.headers()) {
        return sandbox_port(&envd.state, &id, port, req).await;
    }
    let path = req.uri().path().to_string();
    let signed = (path == "/files")
        .then(|| super::files::FilesQuery::parse(req.uri().query()).ok())
        .flatten()
        .filter(|q| q.has_signature())
        .map(|q| {
            (
                q,
                if req.method() == Method::GET {
                    "read"
                } else {
                    "write"
                },
            )
        });
    match admit(&envd.state, &id, req.headers(), &path, signed).await {
        Ok(user) => {
            let mut req = req;
            req.extensions_mut().insert(EnvdCtx {
                id: id.clone(),
                user,
            });
            let actor: std::sync::Arc<str> = format!("envd:{id}").into();
            let router = envd.router.clone();
            crate::events::ACTOR
                .scope(actor, async move {
                    match router.oneshot(req).await {
                        Ok(resp) => resp,
                        Err(never) => match never {},
                    }
                })
                .await
        }
        Err(resp) => resp,
    }
}

/// Checks what E2B's proxy and envd check before a call: the sandbox exists and runs, the
/// port is envd's, the access token is the sandbox's (all but `/health`), and the user
/// header parses. Returns the user.
async fn admit(
    state: &AppState,
    id: &str,
    headers: &HeaderMap,
    path: &str,
    signed: Option<(super::files::FilesQuery, &str)>,
) -> Result<Option<String>, Response> {
    if !space_api::is_valid_sandbox_id(id) {
        return Err(super::sandbox_gone(id));
    }
    let row = match state.engine.store().get_sandbox(id).await {
        Ok(Some(row)) if row.deleted_at.is_none() && row.state != SandboxState::Deleting => row,
        Ok(_) => return Err(super::sandbox_gone(id)),
        Err(e) => return Err(ConnectError::from(crate::ControlError::from(e)).into_response()),
    };
    if matches!(row.state, SandboxState::Paused | SandboxState::Stopped) {
        return Err(plain_error(
            StatusCode::BAD_GATEWAY,
            format!("The sandbox {id} is paused: resume it with a connect"),
        ));
    }
    if path == "/health" {
        return Ok(None);
    }
    if let Some((q, operation)) = signed {
        // A signed /files URL: the signature stands in for the token.
        let now = crate::store::now_ms() / 1000;
        q.verify(operation, &state.engine.ports.envd_token(id), now)
            .map_err(|e| plain_error(StatusCode::UNAUTHORIZED, e))?;
        return user_of(headers).map_err(|e| plain_error(StatusCode::BAD_REQUEST, e));
    }
    let token = headers
        .get("x-access-token")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !state.engine.ports.verify_envd_token(id, token) {
        return Err(plain_error(
            StatusCode::UNAUTHORIZED,
            format!("missing or invalid X-Access-Token for sandbox {id}"),
        ));
    }
    user_of(headers).map_err(|e| plain_error(StatusCode::BAD_REQUEST, e))
}

/// The `E2b-Sandbox-Port` of a request for a port other than envd's: the port, or the
/// header as written when it is no port number (refused by [`sandbox_port`]).
fn other_port(headers: &HeaderMap) -> Option<Result<u16, String>> {
    let raw = headers.get(super::SANDBOX_PORT_HEADER)?;
    let text = raw.to_str().unwrap_or("?");
    match text.parse::<u16>() {
        Ok(super::ENVD_PORT) => None,
        Ok(port) => Some(Ok(port)),
        Err(_) => Some(Err(text.to_owned())),
    }
}

/// A request for another port of the sandbox (the code interpreter's 49999, an app's),
/// as E2B's proxy passes them on: sent to `127.0.0.1:PORT` inside as it came. It needs the
/// sandbox's traffic access token (`E2B-Traffic-Access-Token`) or its envd access token;
/// space's port URLs (`POST /v1/sandboxes/{id}/ports`) are the native way in.
async fn sandbox_port(
    state: &AppState,
    id: &str,
    port: Result<u16, String>,
    req: Request,
) -> Response {
    if !space_api::is_valid_sandbox_id(id) {
        return super::sandbox_gone(id);
    }
    let port = match port {
        Ok(port) => port,
        Err(port) => {
            return plain_error(
                StatusCode::BAD_REQUEST,
                format!("E2b-Sandbox-Port must be a port number, got {port:?}"),
            );
        }
    };
    let headers = req.headers();
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    };
    let ports = &state.engine.ports;
    let allowed = ports.verify_traffic_token(id, header("e2b-traffic-access-token"))
        || ports.verify_envd_token(id, header("x-access-token"));
    if !allowed {
        return plain_error(
            StatusCode::UNAUTHORIZED,
            format!(
                "port {port} of sandbox {id} wants its E2B-Traffic-Access-Token or X-Access-Token"
            ),
        );
    }
    let path = req
        .uri()
        .path_and_query()
        .map_or("/".to_owned(), |p| p.as_str().to_owned());
    crate::port_proxy::forward(state, id, port, req, &path, None).await
}

/// E2B's plain error body (what its proxy answers with before envd is reached).
fn plain_error(status: StatusCode, message: String) -> Response {
    let body = serde_json::json!({"code": status.as_u16(), "message": message});
    (status, axum::Json(body)).into_response()
}

/// `Authorization: Basic base64("<user>:")`, as the SDKs name the user of a call.
fn user_of(headers: &HeaderMap) -> Result<Option<String>, String> {
    let Some(v) = headers.get(header::AUTHORIZATION) else {
        return Ok(None);
    };
    let bad = || "Authorization must be Basic base64(\"<user>:\")".to_string();
    let v = v.to_str().map_err(|_| bad())?;
    let (scheme, b64) = v.split_once(' ').ok_or_else(bad)?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return Err(bad());
    }
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|_| bad())?;
    let text = String::from_utf8(raw).map_err(|_| bad())?;
    let user = text.split(':').next().unwrap_or("");
    Ok((!user.is_empty()).then(|| user.to_string()))
}

pub(crate) async fn read_body(body: Body) -> Result<Bytes, ConnectError> {
    axum::body::to_bytes(body, connect::MAX_MESSAGE_BYTES + 5)
        .await
        .map_err(|e| {
            ConnectError::new(
                Code::ResourceExhausted,
                format!(
                    "request body over {} bytes, or unreadable: {e}",
                    connect::MAX_MESSAGE_BYTES
                ),
            )
        })
}

/// `Keepalive-Ping-Interval` (seconds) and `Connect-Timeout-Ms` of a streaming call.
pub(crate) struct StreamLimits {
    keepalive: Option<Duration>,
    timeout: Option<Duration>,
}

impl StreamLimits {
    pub(crate) fn of(headers: &HeaderMap) -> Result<Self, ConnectError> {
        let keepalive = match headers.get("keepalive-ping-interval") {
            None => None,
            Some(v) => {
                let secs: u64 = v
                    .to_str()
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| {
                        ConnectError::invalid("Keepalive-Ping-Interval must be whole seconds")
                    })?;
                Some(Duration::from_secs(secs.clamp(1, 3600)))
            }
        };
        Ok(Self {
            keepalive,
            timeout: connect::timeout(headers)?,
        })
    }

    /// A process's `events` with a keepalive event every interval, ended by
    /// `deadline_exceeded` once the timeout passes (the process itself is left alone).
    fn apply(
        self,
        events: BoxStream<'static, Result<pb::ProcessEvent, ConnectError>>,
    ) -> BoxStream<'static, Result<pb::ProcessEvent, ConnectError>> {
        self.with(
            events,
            || {
                event(pb::process_event::Event::Keepalive(
                    pb::process_event::KeepAlive {},
                ))
            },
            "the call's Connect-Timeout-Ms passed; the process keeps running \
             (Connect reaches it again)",
        )
    }

    /// `events` with `keepalive()` every interval, ended by `deadline_exceeded` (`expired`)
    /// once the timeout passes.
    pub(crate) fn with<T: Send + 'static>(
        self,
        events: BoxStream<'static, Result<T, ConnectError>>,
        keepalive: fn() -> T,
        expired: &'static str,
    ) -> BoxStream<'static, Result<T, ConnectError>> {
        let deadline = self.timeout.map(|t| tokio::time::Instant::now() + t);
        let ticker = self.keepalive.map(|every| {
            let mut t = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        });
        futures::stream::unfold(Some((events, ticker, deadline)), move |st| async move {
            let (mut events, mut ticker, deadline) = st?;
            let tick = async {
                match ticker.as_mut() {
                    Some(t) => {
                        t.tick().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            let expire = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                ev = events.next() => {
                    let ev = ev?;
                    Some((ev, Some((events, ticker, deadline))))
                }
                _ = tick => Some((Ok(keepalive()), Some((events, ticker, deadline)))),
                _ = expire => Some((Err(ConnectError::new(Code::DeadlineExceeded, expired)), None)),
            }
        })
        .boxed()
    }
}

fn event(e: pb::process_event::Event) -> pb::ProcessEvent {
    pb::ProcessEvent { event: Some(e) }
}

fn data(output: pb::process_event::data_event::Output) -> pb::ProcessEvent {
    event(pb::process_event::Event::Data(
        pb::process_event::DataEvent {
            output: Some(output),
        },
    ))
}

/// The name Go gives a signal in a process state ("signal: killed"), as envd reports it.
fn signal_name(sig: i32) -> String {
    match sig {
        1 => "hangup".into(),
        2 => "interrupt".into(),
        3 => "quit".into(),
        6 => "aborted".into(),
        9 => "killed".into(),
        11 => "segmentation fault".into(),
        13 => "broken pipe".into(),
        15 => "terminated".into(),
        n => format!("signal {n}"),
    }
}

/// envd's end event for an exit: a code, or a signal (exit code -1, not `exited`).
fn end_event(code: Option<i32>, signal: Option<i32>) -> pb::process_event::EndEvent {
    match (code, signal) {
        (_, Some(sig)) => pb::process_event::EndEvent {
            exit_code: -1,
            exited: false,
            status: format!("signal: {}", signal_name(sig)),
            error: None,
        },
        (code, None) => {
            let code = code.unwrap_or(0);
            pb::process_event::EndEvent {
                exit_code: code,
                exited: true,
                status: format!("exit status {code}"),
                error: None,
            }
        }
    }
}

/// One of space's exec events as envd's (`Gap` has no envd form and is skipped).
fn process_event(ev: ExecEvent) -> Option<Result<pb::ProcessEvent, ConnectError>> {
    use pb::process_event::Event;
    use pb::process_event::data_event::Output;
    Some(Ok(match ev {
        ExecEvent::Started { pid } => event(Event::Start(pb::process_event::StartEvent { pid })),
        ExecEvent::Stdout { data: d, .. } => data(Output::Stdout(d)),
        ExecEvent::Stderr { data: d, .. } => data(Output::Stderr(d)),
        ExecEvent::Pty { data: d, .. } => data(Output::Pty(d)),
        ExecEvent::Gap { .. } => return None,
        ExecEvent::Exit { code, signal } => event(Event::End(end_event(code, signal))),
        ExecEvent::Error { message, .. } => {
            return Some(Err(ConnectError::new(Code::Unavailable, message)));
        }
    }))
}

fn process_events(
    events: BoxStream<'static, ExecEvent>,
) -> BoxStream<'static, Result<pb::ProcessEvent, ConnectError>> {
    events
        .filter_map(|ev| std::future::ready(process_event(ev)))
        .boxed()
}

/// The pid a selector names: a pid as given, a tag resolved among the running processes.
async fn pid_of(
    s: &AppState,
    id: &str,
    sel: Option<pb::ProcessSelector>,
) -> Result<u32, ConnectError> {
    match sel.and_then(|s| s.selector) {
        Some(pb::process_selector::Selector::Pid(pid)) => Ok(pid),
        Some(pb::process_selector::Selector::Tag(tag)) => s
            .engine
            .list_processes(id)
            .await?
            .into_iter()
            .find(|p| p.running && p.tag == tag)
            .map(|p| p.pid)
            .ok_or_else(|| {
                ConnectError::new(
                    Code::NotFound,
                    format!("no running process has tag {tag:?}"),
                )
            }),
        None => Err(ConnectError::invalid(
            "a process selector (pid or tag) is required",
        )),
    }
}

// ---- process.Process ----

async fn start(
    State(s): State<AppState>,
    Extension(ctx): Extension<EnvdCtx>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    stream_call(&headers, body, |req: pb::StartRequest, limits| async move {
        let events = start_process(&s, &ctx, req).await?;
        Ok(limits
            .apply(events)
            .map(|ev| ev.map(|ev| pb::StartResponse { event: Some(ev) }))
            .boxed())
    })
    .await
}

async fn start_process(
    s: &AppState,
    ctx: &EnvdCtx,
    req: pb::StartRequest,
) -> Result<BoxStream<'static, Result<pb::ProcessEvent, ConnectError>>, ConnectError> {
    let process = req
        .process
        .ok_or_else(|| ConnectError::invalid("process is required"))?;
    if process.cmd.is_empty() {
        return Err(ConnectError::invalid("process.cmd is required"));
    }
    let size = req.pty.as_ref().map(|p| p.size.unwrap_or_default());
    let tty = size.is_some();
    let mut cmd = vec![process.cmd];
    cmd.extend(process.args);
    let exec = ExecRequest {
        cmd,
        env: process.envs.into_iter().collect(),
        cwd: process.cwd.filter(|c| !c.is_empty()),
        user: ctx.user.clone(),
        tty,
        rows: size.map(|s| s.rows.clamp(1, u16::MAX as u32) as u16),
        cols: size.map(|s| s.cols.clamp(1, u16::MAX as u32) as u16),
        // envd keeps stdin open unless told not to (SDKs before envd 0.3.0 cannot say).
        stdin: tty || req.stdin.unwrap_or(true),
        stdin_data: None,
        tag: req.tag.filter(|t| !t.is_empty()),
        background: false,
    };
    // Audited as the native exec is: the action, never the command line (it may hold secrets).
    let reply = s.engine.exec(&ctx.id, exec).await;
    let result = reply.as_ref().map_or_else(|e| e.code(), |_| "ok");
    s.engine.event(&ctx.id, "exec", result, "via envd");
    let ExecReply::Events(events) = reply? else {
        return Err(ConnectError::from(crate::ControlError::internal(
            "a foreground exec answered as a background one",
        )));
    };
    let events = crate::snapshot_policy::after_exec(&s.engine, &ctx.id, events);
    Ok(process_events(events))
}

async fn connect_process(
    State(s): State<AppState>,
    Extension(ctx): Extension<EnvdCtx>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    stream_call(
        &headers,
        body,
        |req: pb::ConnectRequest, limits| async move {
            let pid = pid_of(&s, &ctx.id, req.process).await?;
            let output = s.engine.process_output(&ctx.id, pid, 0, true).await?;
            let start = futures::stream::once(std::future::ready(Ok(event(
                pb::process_event::Event::Start(pb::process_event::StartEvent { pid }),
            ))));
            Ok(limits
                .apply(start.chain(process_events(output)).boxed())
                .map(|ev| ev.map(|ev| pb::ConnectResponse { event: Some(ev) }))
                .boxed())
        },
    )
    .await
}

async fn list(
    State(s): State<AppState>,
    Extension(ctx): Extension<EnvdCtx>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    unary_call(&headers, body, |_: pb::ListRequest| async move {
        let processes = s
            .engine
            .list_processes(&ctx.id)
            .await?
            .into_iter()
            .filter(|p| p.running)
            .map(|p| {
                let mut cmd = p.cmd.into_iter();
                pb::ProcessInfo {
                    config: Some(pb::ProcessConfig {
                        cmd: cmd.next().unwrap_or_default(),
                        args: cmd.collect(),
                        envs: Default::default(),
                        cwd: None,
                    }),
                    pid: p.pid,
                    tag: Some(p.tag).filter(|t| !t.is_empty()),
                }
            })
            .collect();
        Ok(pb::ListResponse { processes })
    })
    .await
}

/// A server-streaming call: the request's one message and its limits, then `f`'s stream of
/// replies (or the error that ends the stream at once).
pub(crate) async fn stream_call<Req, T, Fut>(
    headers: &HeaderMap,
    body: Body,
    f: impl FnOnce(Req, StreamLimits) -> Fut,
) -> Response
where
    Req: serde::de::DeserializeOwned,
    T: serde::Serialize + Send + 'static,
    Fut: std::future::Future<
            Output = Result<BoxStream<'static, Result<T, ConnectError>>, ConnectError>,
        >,
{
    let result = async {
        let body = read_body(body).await?;
        let req = connect::stream_request(headers, &body)?;
        f(req, StreamLimits::of(headers)?).await
    }
    .await;
    match result {
        Ok(events) => connect::stream_reply(events),
        Err(e) => connect::stream_error(e),
    }
}

/// A unary call: the request message (or its error), `f`, and the reply (or its error).
pub(crate) async fn unary_call<Req, Resp, Fut>(
    headers: &HeaderMap,
    body: Body,
    f: impl FnOnce(Req) -> Fut,
) -> Response
where
    Req: serde::de::DeserializeOwned,
    Resp: serde::Serialize,
    Fut: std::future::Future<Output = Result<Resp, ConnectError>>,
{
    let result = async {
        let body = read_body(body).await?;
        f(connect::unary_request(headers, &body)?).await
    }
    .await;
    match result {
        Ok(msg) => connect::unary_reply(&msg),
        Err(e) => e.into_response(),
    }
}

/// The bytes of a `ProcessInput` (stdin and PTY input both go to the process's input).
fn input_bytes(input: Option<pb::ProcessInput>) -> Vec<u8> {
    match input.and_then(|i| i.input) {
        Some(pb::process_input::Input::Stdin(b) | pb::process_input::Input::Pty(b)) => b,
        None => Vec::new(),
    }
}

async fn send_input(
    State(s): State<AppState>,
    Extension(ctx): Extension<EnvdCtx>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    unary_call(&headers, body, |req: pb::SendInputRequest| async move {
        let pid = pid_of(&s, &ctx.id, req.process).await?;
        let data = input_bytes(req.input);
        if !data.is_empty() {
            s.engine.write_stdin(&ctx.id, pid, data.into()).await?;
        }
        Ok(pb::SendInputResponse {})
    })
    .await
}

async fn stream_input(
    State(s): State<AppState>,
    Extension(ctx): Extension<EnvdCtx>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    use pb::stream_input_request::Event;
    let result = async {
        connect::check_stream_headers(&headers)?;
        let mut messages = connect::request_messages::<pb::StreamInputRequest>(body);
        let pid = match messages.next().await.transpose()?.and_then(|m| m.event) {
            Some(Event::Start(start)) => pid_of(&s, &ctx.id, start.process).await?,
            _ => {
                return Err(ConnectError::invalid(
                    "a StreamInput stream starts with a start event",
                ));
            }
        };
        while let Some(msg) = messages.next().await {
            match msg?.event {
                Some(Event::Data(d)) => {
                    let data = input_bytes(d.input);
                    if !data.is_empty() {
                        s.engine.write_stdin(&ctx.id, pid, data.into()).await?;
                    }
                }
                Some(Event::Keepalive(_)) | None => {}
                Some(Event::Start(_)) => {
                    return Err(ConnectError::invalid("a second start event"));
                }
            }
        }
        Ok(pb::StreamInputResponse {})
    }
    .await;
    match result {
        Ok(msg) => connect::stream_reply(futures::stream::once(std::future::ready(Ok(msg)))),
        Err(e) => connect::stream_error(e),
    }
}

async fn close_stdin(
    State(s): State<AppState>,
    Extension(ctx): Extension<EnvdCtx>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    unary_call(&headers, body, |req: pb::CloseStdinRequest| async move {
        let pid = pid_of(&s, &ctx.id, req.process).await?;
        s.engine.close_stdin(&ctx.id, pid).await?;
        Ok(pb::CloseStdinResponse {})
    })
    .await
}

async fn send_signal(
    State(s): State<AppState>,
    Extension(ctx): Extension<EnvdCtx>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    unary_call(&headers, body, |req: pb::SendSignalRequest| async move {
        let signal = match pb::Signal::try_from(req.signal) {
            Ok(pb::Signal::Sigkill) => 9,
            Ok(pb::Signal::Sigterm) => 15,
            _ => {
                return Err(ConnectError::invalid(format!(
                    "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM, got {}",
                    req.signal
                )));
            }
        };
        let pid = pid_of(&s, &ctx.id, req.process).await?;
        s.engine
            .signal(
                &ctx.id,
                pid,
                SignalRequest {
                    signal: SignalSpec::Number(signal),
                    group: false,
                },
            )
            .await?;
        s.engine
            .event(&ctx.id, "signal", "ok", &format!("process={pid}"));
        Ok(pb::SendSignalResponse {})
    })
    .await
}

async fn update(
    State(s): State<AppState>,
    Extension(ctx): Extension<EnvdCtx>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    unary_call(&headers, body, |req: pb::UpdateRequest| async move {
        let pid = pid_of(&s, &ctx.id, req.process).await?;
        let size = req
            .pty
            .and_then(|p| p.size)
            .ok_or_else(|| ConnectError::invalid("pty.size is required"))?;
        let clamp = |v: u32| v.min(u16::MAX as u32) as u16;
        s.engine
            .resize(&ctx.id, pid, clamp(size.rows), clamp(size.cols))
            .await?;
        Ok(pb::UpdateResponse {})
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_have_envds_json_shape() {
        let start = process_event(ExecEvent::Started { pid: 7 })
            .unwrap()
            .unwrap();
        let v = serde_json::to_value(pb::StartResponse { event: Some(start) }).unwrap();
        assert_eq!(v, serde_json::json!({"event": {"start": {"pid": 7}}}));
        let out = process_event(ExecEvent::Stdout {
            offset: 0,
            data: b"hi\n".to_vec(),
        })
        .unwrap()
        .unwrap();
        let v = serde_json::to_value(&out).unwrap();
        assert_eq!(v, serde_json::json!({"data": {"stdout": "aGkK"}}));
        let end = process_event(ExecEvent::Exit {
            code: Some(3),
            signal: None,
        })
        .unwrap()
        .unwrap();
        let v = serde_json::to_value(&end).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"end": {"exitCode": 3, "exited": true, "status": "exit status 3"}})
        );
        let killed = serde_json::to_value(event(pb::process_event::Event::End(end_event(
            None,
            Some(9),
        ))))
        .unwrap();
        assert_eq!(killed["end"]["status"], "signal: killed");
        assert_eq!(killed["end"]["exitCode"], -1);
        assert!(process_event(ExecEvent::Gap { from: 0, to: 1 }).is_none());
    }

    #[test]
    fn requests_parse_as_the_sdk_sends_them() {
        let req: pb::StartRequest = serde_json::from_value(serde_json::json!({
            "process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"], "envs": {"A": "1"}},
            "stdin": false,
            "unknownField": 1,
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        let p = req.process.unwrap();
        assert_eq!(p.args, ["-l", "-c", "echo hi"]);
        assert_eq!(req.stdin, Some(false));
        let sig: pb::SendSignalRequest = serde_json::from_value(serde_json::json!({
            "process": {"pid": 12},
            "signal": "SIGNAL_SIGKILL",
        }))
        .unwrap();
        assert_eq!(sig.signal, pb::Signal::Sigkill as i32);
        let input: pb::SendInputRequest = serde_json::from_value(serde_json::json!({
            "process": {"tag": "t"},
            "input": {"stdin": "aGkK"},
        }))
        .unwrap();
        assert_eq!(input_bytes(input.input), b"hi\n");
    }

    #[test]
    fn the_user_comes_from_basic_auth() {
        let mut h = HeaderMap::new();
        assert_eq!(user_of(&h), Ok(None));
        h.insert(header::AUTHORIZATION, "Basic cm9vdDo=".parse().unwrap()); // "root:"
        assert_eq!(user_of(&h), Ok(Some("root".into())));
        h.insert(header::AUTHORIZATION, "Bearer x".parse().unwrap());
        assert!(user_of(&h).is_err());
        h.insert(header::AUTHORIZATION, "Basic !!".parse().unwrap());
        assert!(user_of(&h).is_err());
    }
}
