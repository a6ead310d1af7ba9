//! An async client of the REST API v1 (reqwest). One method per endpoint; streams stay
//! streams (exec events, file bodies), nothing is buffered whole unless a `*_bytes` helper
//! says so.

use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use futures::{Stream, StreamExt, TryStreamExt};
use reqwest::{Method, RequestBuilder, Response, StatusCode};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::types::*;

#[path = "client_diff.rs"]
mod client_diff;
#[path = "client_snapshots.rs"]
mod snapshots;

#[path = "client_events.rs"]
mod events;
#[path = "client_net.rs"]
mod net;
#[path = "client_pool.rs"]
mod pool;

#[path = "client_tenants.rs"]
mod tenants;

/// Errors of [`Client`].
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error body.
    #[error("{message} ({code})")]
    Api {
        status: u16,
        code: String,
        message: String,
    },
    #[error("request to {url} failed")]
    Http {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// The server's reply could not be understood.
    #[error("invalid response: {0}")]
    Decode(String),
    #[error("failed to read {path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl ClientError {
    /// HTTP status of an API error.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Stable error code: the API's code, or "transport"/"decode"/"io".
    pub fn code(&self) -> &str {
        match self {
            ClientError::Api { code, .. } => code,
            ClientError::Http { .. } => "transport",
            ClientError::Decode(_) => "decode",
            ClientError::Io { .. } => "io",
        }
    }
}

pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// A boxed stream of exec events (ndjson lines, parsed).
pub type EventStream = Pin<Box<dyn Stream<Item = Result<ExecEvent>> + Send>>;
/// A boxed stream of raw bytes (file contents).
pub type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes>> + Send>>;

/// What a foreground exec produced, collected.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecOutput {
    pub pid: u32,
    pub stdout: Vec<u8>,
    /// stderr, or nothing under a PTY (PTY output is in stdout).
    pub stderr: Vec<u8>,
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

impl ExecOutput {
    /// Shell-style status: the code, or 128 + signal.
    pub fn status(&self) -> i32 {
        match (self.code, self.signal) {
            (_, Some(sig)) => 128 + sig,
            (Some(code), None) => code,
            (None, None) => -1,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    key: String,
}

/// Makes ring the process's rustls crypto provider unless one is set. reqwest's TLS comes
/// without one (space builds rustls on ring only), so every process that builds a
/// `reqwest::Client` calls this first; calling it again is harmless.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

impl Client {
    /// `base_url` like `http://127.0.0.1:7070`; `api_key` is sent as a bearer token.
    pub fn new(base_url: &str, api_key: &str) -> Result<Self> {
        install_crypto_provider();
        let http = reqwest::Client::builder()
            .tcp_nodelay(true)
            .pool_max_idle_per_host(32)
            .build()
            .map_err(|source| ClientError::Http {
                url: base_url.to_string(),
                source,
            })?;
        Ok(Self {
            http,
            base: base_url.trim_end_matches('/').to_string(),
            key: api_key.to_string(),
        })
    }

    pub fn base_url(&self) -> &str {
        &self.base
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    fn request(&self, method: Method, path: &str) -> RequestBuilder {
        self.http
            .request(method, self.url(path))
            .bearer_auth(&self.key)
    }

    async fn send(&self, rb: RequestBuilder) -> Result<Response> {
        let req = rb.build().map_err(|source| ClientError::Http {
            url: self.base.clone(),
            source,
        })?;
        let url = req.url().to_string();
        let resp = self
            .http
            .execute(req)
            .await
            .map_err(|source| ClientError::Http { url, source })?;
        check(resp).await
    }

    async fn json<T: DeserializeOwned>(&self, rb: RequestBuilder) -> Result<T> {
        let resp = self.send(rb).await?;
        let url = resp.url().to_string();
        let bytes = resp
            .bytes()
            .await
            .map_err(|source| ClientError::Http { url, source })?;
        serde_json::from_slice(&bytes).map_err(|e| ClientError::Decode(e.to_string()))
    }

    async fn empty(&self, rb: RequestBuilder) -> Result<()> {
        self.send(rb).await.map(drop)
    }

    fn with_json<B: Serialize>(rb: RequestBuilder, body: &B) -> RequestBuilder {
        rb.json(body)
    }

    // ---- service ----

    /// `GET /healthz` (no auth needed).
    pub async fn health(&self) -> Result<Health> {
        self.json(self.http.get(self.url("/healthz"))).await
    }

    /// `GET /metrics` (Prometheus text).
    pub async fn metrics(&self) -> Result<String> {
        let resp = self.send(self.request(Method::GET, "/metrics")).await?;
        let url = resp.url().to_string();
        resp.text()
            .await
            .map_err(|source| ClientError::Http { url, source })
    }

    /// `GET /v1/e2b`: the server's E2B domain and the CA its certificates come from.
    pub async fn e2b_settings(&self) -> Result<crate::E2bSettings> {
        self.json(self.request(Method::GET, "/v1/e2b")).await
    }

    // ---- sandboxes ----

    /// `GET /v1/sandboxes/{id}/metrics`: the sandbox's recent CPU, memory and disk use.
    pub async fn sandbox_metrics(&self, id: &str, q: &MetricsQuery) -> Result<SandboxMetrics> {
        self.json(
            self.request(Method::GET, &format!("/v1/sandboxes/{id}/metrics"))
                .query(q),
        )
        .await
    }

    pub async fn create_sandbox(&self, req: &CreateSandbox) -> Result<Sandbox> {
        self.json(Self::with_json(
            self.request(Method::POST, "/v1/sandboxes"),
            req,
        ))
        .await
    }

    /// A create with an `Idempotency-Key`: retried with the same key (and request), it
    /// answers the sandbox the first try made instead of making another.
    pub async fn create_sandbox_keyed(&self, req: &CreateSandbox, key: &str) -> Result<Sandbox> {
        self.json(Self::with_json(
            self.request(Method::POST, "/v1/sandboxes")
                .header("Idempotency-Key", key),
            req,
        ))
        .await
    }

    pub async fn list_sandboxes(&self) -> Result<Vec<Sandbox>> {
        let list: SandboxList = self
            .json(self.request(Method::GET, "/v1/sandboxes"))
            .await?;
        Ok(list.sandboxes)
    }

    pub async fn get_sandbox(&self, id: &str) -> Result<Sandbox> {
        self.json(self.request(Method::GET, &format!("/v1/sandboxes/{id}")))
            .await
    }

    pub async fn delete_sandbox(&self, id: &str) -> Result<()> {
        self.empty(self.request(Method::DELETE, &format!("/v1/sandboxes/{id}")))
            .await
    }

    /// Freezes the sandbox (no CPU, memory kept). 409 if it is not running.
    pub async fn pause_sandbox(&self, id: &str) -> Result<Sandbox> {
        self.json(self.request(Method::POST, &format!("/v1/sandboxes/{id}/pause")))
            .await
    }

    /// A pause as `req` asks: `memory: Some(false)` stops every process and keeps only the
    /// filesystem (the sandbox is `stopped`; `resume` starts it again).
    pub async fn pause_sandbox_with(&self, id: &str, req: &crate::PauseRequest) -> Result<Sandbox> {
        self.json(
            self.request(Method::POST, &format!("/v1/sandboxes/{id}/pause"))
                .json(req),
        )
        .await
    }

    /// Thaws a paused sandbox. 409 if it is not paused.
    pub async fn resume_sandbox(&self, id: &str) -> Result<Sandbox> {
        self.json(self.request(Method::POST, &format!("/v1/sandboxes/{id}/resume")))
            .await
    }

    /// Sets (counting from now) or clears the sandbox's timeout.
    pub async fn set_timeout(&self, id: &str, req: &crate::SetTimeout) -> Result<Sandbox> {
        self.json(Self::with_json(
            self.request(Method::POST, &format!("/v1/sandboxes/{id}/timeout")),
            req,
        ))
        .await
    }

    // ---- exec and processes ----

    /// Foreground exec: a stream of events, `Started` first and `Exit` (or `Error`) last.
    /// `req.background` is forced off.
    pub async fn exec(&self, id: &str, req: &ExecRequest) -> Result<EventStream> {
        let mut req = req.clone();
        req.background = false;
        let resp = self
            .send(Self::with_json(
                self.request(Method::POST, &format!("/v1/sandboxes/{id}/exec")),
                &req,
            ))
            .await?;
        Ok(ndjson_events(resp))
    }

    /// Foreground exec, collected: waits for the exit and returns all output.
    pub async fn exec_output(&self, id: &str, req: &ExecRequest) -> Result<ExecOutput> {
        let mut events = self.exec(id, req).await?;
        let mut out = ExecOutput::default();
        while let Some(ev) = events.next().await {
            match ev? {
                ExecEvent::Started { pid } => out.pid = pid,
                ExecEvent::Stdout { data, .. } | ExecEvent::Pty { data, .. } => {
                    out.stdout.extend_from_slice(&data)
                }
                ExecEvent::Stderr { data, .. } => out.stderr.extend_from_slice(&data),
                ExecEvent::Gap { .. } => {}
                ExecEvent::Exit { code, signal } => {
                    out.code = code;
                    out.signal = signal;
                    return Ok(out);
                }
                ExecEvent::Error { code, message } => {
                    return Err(ClientError::Api {
                        status: 200,
                        code,
                        message,
                    });
                }
            }
        }
        Err(ClientError::Decode(
            "exec stream ended without an exit event".into(),
        ))
    }

    /// Background exec: returns the pid as soon as the process runs.
    pub async fn exec_background(&self, id: &str, req: &ExecRequest) -> Result<u32> {
        let mut req = req.clone();
        req.background = true;
        let started: Started = self
            .json(Self::with_json(
                self.request(Method::POST, &format!("/v1/sandboxes/{id}/exec")),
                &req,
            ))
            .await?;
        Ok(started.pid)
    }

    pub async fn list_processes(&self, id: &str) -> Result<Vec<ProcessInfo>> {
        let list: ProcessList = self
            .json(self.request(Method::GET, &format!("/v1/sandboxes/{id}/processes")))
            .await?;
        Ok(list.processes)
    }

    /// Output of a process from `offset` (reconnect). With `follow`, streams until it exits.
    pub async fn process_output(
        &self,
        id: &str,
        pid: u32,
        offset: u64,
        follow: bool,
    ) -> Result<EventStream> {
        let resp = self
            .send(
                self.request(
                    Method::GET,
                    &format!("/v1/sandboxes/{id}/processes/{pid}/output"),
                )
                .query(&OutputQuery {
                    offset,
                    follow: Some(follow),
                }),
            )
            .await?;
        Ok(ndjson_events(resp))
    }

    pub async fn write_stdin(&self, id: &str, pid: u32, data: impl Into<Bytes>) -> Result<()> {
        self.empty(
            self.request(
                Method::POST,
                &format!("/v1/sandboxes/{id}/processes/{pid}/stdin"),
            )
            .header("content-type", "application/octet-stream")
            .body(data.into()),
        )
        .await
    }

    pub async fn close_stdin(&self, id: &str, pid: u32) -> Result<()> {
        self.empty(self.request(
            Method::POST,
            &format!("/v1/sandboxes/{id}/processes/{pid}/stdin/close"),
        ))
        .await
    }

    pub async fn signal(&self, id: &str, pid: u32, req: &SignalRequest) -> Result<()> {
        self.empty(Self::with_json(
            self.request(
                Method::POST,
                &format!("/v1/sandboxes/{id}/processes/{pid}/signal"),
            ),
            req,
        ))
        .await
    }

    pub async fn resize(&self, id: &str, pid: u32, rows: u16, cols: u16) -> Result<()> {
        self.empty(Self::with_json(
            self.request(
                Method::POST,
                &format!("/v1/sandboxes/{id}/processes/{pid}/resize"),
            ),
            &ResizeRequest { rows, cols },
        ))
        .await
    }

    // ---- files ----

    /// File contents as a stream of chunks.
    pub async fn read_file(&self, id: &str, path: &str) -> Result<ByteStream> {
        let resp = self
            .send(
                self.request(Method::GET, &format!("/v1/sandboxes/{id}/files"))
                    .query(&[("path", path)]),
            )
            .await?;
        let url = resp.url().to_string();
        Ok(Box::pin(resp.bytes_stream().map_err(move |source| {
            ClientError::Http {
                url: url.clone(),
                source,
            }
        })))
    }

    /// File contents, collected in memory.
    pub async fn read_file_bytes(&self, id: &str, path: &str) -> Result<Vec<u8>> {
        let mut stream = self.read_file(id, path).await?;
        let mut out = Vec::new();
        while let Some(chunk) = stream.next().await {
            out.extend_from_slice(&chunk?);
        }
        Ok(out)
    }

    /// Writes a file from any body (bytes, or a stream via `reqwest::Body::wrap_stream`).
    /// `mode` is permission bits (e.g. 0o644); `parents` creates missing directories.
    pub async fn write_file(
        &self,
        id: &str,
        path: &str,
        mode: Option<u32>,
        parents: bool,
        body: impl Into<reqwest::Body>,
    ) -> Result<EntryInfo> {
        let query = WriteFileQuery {
            path: path.to_string(),
            user: None,
            mode: mode.map(|m| format!("{m:o}")),
            parents: parents.then_some(true),
        };
        self.json(
            self.request(Method::PUT, &format!("/v1/sandboxes/{id}/files"))
                .query(&query)
                .header("content-type", "application/octet-stream")
                .body(body),
        )
        .await
    }

    /// Streams a local file into the sandbox.
    pub async fn upload_file(
        &self,
        id: &str,
        local: &Path,
        path: &str,
        mode: Option<u32>,
        parents: bool,
    ) -> Result<EntryInfo> {
        let body = file_body(local).await?;
        self.write_file(id, path, mode, parents, body).await
    }

    pub async fn remove_file(&self, id: &str, path: &str, recursive: bool) -> Result<()> {
        let query = PathQuery {
            path: path.to_string(),
            recursive: recursive.then_some(true),
            depth: None,
        };
        self.empty(
            self.request(Method::DELETE, &format!("/v1/sandboxes/{id}/files"))
                .query(&query),
        )
        .await
    }

    pub async fn stat(&self, id: &str, path: &str) -> Result<EntryInfo> {
        self.json(
            self.request(Method::GET, &format!("/v1/sandboxes/{id}/files/stat"))
                .query(&[("path", path)]),
        )
        .await
    }

    /// `GET .../files/watch`: changes under the directory `path` as they happen (`started`
    /// first), until the stream is dropped.
    pub async fn watch(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<Pin<Box<dyn Stream<Item = Result<crate::WatchEvent>> + Send>>> {
        let q = crate::WatchQuery {
            path: path.to_string(),
            recursive,
        };
        let resp = self
            .send(
                self.request(Method::GET, &format!("/v1/sandboxes/{id}/files/watch"))
                    .query(&q),
            )
            .await?;
        Ok(ndjson_lines(resp))
    }

    /// Entries below `path`; `depth` 0 or 1 = direct children only.
    pub async fn list_dir(
        &self,
        id: &str,
        path: &str,
        depth: Option<u32>,
    ) -> Result<Vec<EntryInfo>> {
        let query = PathQuery {
            path: path.to_string(),
            recursive: None,
            depth,
        };
        let list: EntryList = self
            .json(
                self.request(Method::GET, &format!("/v1/sandboxes/{id}/files/list"))
                    .query(&query),
            )
            .await?;
        Ok(list.entries)
    }

    pub async fn mkdir(&self, id: &str, req: &MakeDirRequest) -> Result<EntryInfo> {
        self.json(Self::with_json(
            self.request(Method::POST, &format!("/v1/sandboxes/{id}/files/mkdir")),
            req,
        ))
        .await
    }

    pub async fn rename(&self, id: &str, req: &RenameRequest) -> Result<EntryInfo> {
        self.json(Self::with_json(
            self.request(Method::POST, &format!("/v1/sandboxes/{id}/files/rename")),
            req,
        ))
        .await
    }

    // ---- templates ----

    pub async fn list_templates(&self) -> Result<Vec<Template>> {
        let list: TemplateList = self
            .json(self.request(Method::GET, "/v1/templates"))
            .await?;
        Ok(list.templates)
    }

    /// `PUT /v1/templates/{name}/settings`: replaces the template's settings.
    pub async fn set_template_settings(
        &self,
        name: &str,
        req: &crate::SetTemplateSettings,
    ) -> Result<Template> {
        self.json(Self::with_json(
            self.request(Method::PUT, &format!("/v1/templates/{name}/settings")),
            req,
        ))
        .await
    }

    /// A new version of template `name` from a sandbox's disk snapshot (no copy).
    pub async fn template_from_snapshot(
        &self,
        name: &str,
        req: &crate::TemplateFromSnapshot,
    ) -> Result<Template> {
        self.json(Self::with_json(
            self.request(Method::POST, &format!("/v1/templates/{name}/from-snapshot")),
            req,
        ))
        .await
    }

    /// `POST /v1/templates/{name}/pull`: pulls an image; progress lines as they happen,
    /// ending with `done` (the new version) or `error`.
    pub async fn pull_template(
        &self,
        name: &str,
        req: &crate::PullTemplate,
    ) -> Result<TemplateLogStream> {
        let resp = self
            .send(Self::with_json(
                self.request(Method::POST, &format!("/v1/templates/{name}/pull")),
                req,
            ))
            .await?;
        Ok(ndjson_lines(resp))
    }

    /// `PUT /v1/templates/{name}/start`: a new version with these start settings.
    pub async fn set_template_start(
        &self,
        name: &str,
        req: &crate::SetTemplateStart,
    ) -> Result<Template> {
        self.json(Self::with_json(
            self.request(Method::PUT, &format!("/v1/templates/{name}/start")),
            req,
        ))
        .await
    }

    /// `GET /v1/templates/{name}`: every version and the settings.
    pub async fn get_template(&self, name: &str) -> Result<crate::TemplateDetail> {
        self.json(self.request(Method::GET, &format!("/v1/templates/{name}")))
            .await
    }

    /// `DELETE /v1/templates/{name}`: one version, or all (`None`).
    pub async fn remove_template(
        &self,
        name: &str,
        version: Option<u32>,
    ) -> Result<crate::TemplateRemoved> {
        let mut rb = self.request(Method::DELETE, &format!("/v1/templates/{name}"));
        if let Some(v) = version {
            rb = rb.query(&[("version", v)]);
        }
        self.json(rb).await
    }

    /// `POST /v1/templates/{name}/build`: builds a Dockerfile; `context` is the build
    /// context as a tar archive, `query` the options (`dockerfile`, `no_cache`, `replace`,
    /// `egress`, `insecure`, `build_arg=K=V`...). Progress lines, ending with `done` or
    /// `error`.
    pub async fn build_template(
        &self,
        name: &str,
        query: &[(String, String)],
        context: &Path,
    ) -> Result<TemplateLogStream> {
        let body = file_body(context).await?;
        let resp = self
            .send(
                self.request(Method::POST, &format!("/v1/templates/{name}/build"))
                    .query(query)
                    .header("content-type", "application/x-tar")
                    .body(body),
            )
            .await?;
        Ok(ndjson_lines(resp))
    }

    /// Imports a template from a tar archive body (optionally gzip-compressed).
    /// A name that exists needs `replace` (a new version is then made).
    pub async fn import_template(
        &self,
        name: &str,
        tar: impl Into<reqwest::Body>,
        replace: bool,
    ) -> Result<Template> {
        self.json(
            self.request(Method::PUT, &format!("/v1/templates/{name}"))
                .query(&[("replace", replace)])
                .header("content-type", "application/x-tar")
                .body(tar),
        )
        .await
    }

    /// Imports a template from a local tar archive, streamed.
    pub async fn import_template_file(
        &self,
        name: &str,
        tar: &Path,
        replace: bool,
    ) -> Result<Template> {
        let body = file_body(tar).await?;
        self.import_template(name, body, replace).await
    }
}

async fn file_body(path: &Path) -> Result<reqwest::Body> {
    let file = tokio::fs::File::open(path)
        .await
        .map_err(|source| ClientError::Io {
            path: path.display().to_string(),
            source,
        })?;
    Ok(reqwest::Body::wrap_stream(
        tokio_util::io::ReaderStream::with_capacity(file, 256 * 1024),
    ))
}

/// Turns a non-2xx response into [`ClientError::Api`].
async fn check(resp: Response) -> Result<Response> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let bytes = resp.bytes().await.unwrap_or_default();
    Err(match serde_json::from_slice::<ErrorBody>(&bytes) {
        Ok(body) => ClientError::Api {
            status: status.as_u16(),
            code: body.error.code,
            message: body.error.message,
        },
        Err(_) => ClientError::Api {
            status: status.as_u16(),
            code: default_code(status).to_string(),
            message: String::from_utf8_lossy(&bytes).trim().to_string(),
        },
    })
}

/// Follows a template's progress to its end: each line goes to `on_line`; the `done` line's
/// template is the result, an `error` line an [`ClientError::Api`] error (status from its
/// code), a stream that ends with neither a decode error.
pub async fn finish_template_log(
    mut log: TemplateLogStream,
    mut on_line: impl FnMut(&crate::TemplateLog),
) -> Result<Template> {
    use futures::StreamExt;
    while let Some(line) = log.next().await {
        let line = line?;
        on_line(&line);
        match line {
            crate::TemplateLog::Done { template } => return Ok(template),
            crate::TemplateLog::Error { error } => {
                return Err(ClientError::Api {
                    status: status_of_code(&error.code),
                    code: error.code,
                    message: error.message,
                });
            }
            _ => {}
        }
    }
    Err(ClientError::Decode(
        "the server ended the progress stream without a result".into(),
    ))
}

/// The HTTP status an error code stands for (the inverse of [`default_code`]).
fn status_of_code(code: &str) -> u16 {
    [400u16, 401, 403, 404, 409, 412, 413, 416, 429, 503]
        .into_iter()
        .find(|s| default_code(StatusCode::from_u16(*s).unwrap_or(StatusCode::OK)) == code)
        .unwrap_or(500)
}

fn default_code(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "invalid_argument",
        401 => "unauthorized",
        403 => "permission_denied",
        404 => "not_found",
        409 => "conflict",
        412 => "failed_precondition",
        413 => "payload_too_large",
        416 => "out_of_range",
        429 | 507 => "resource_exhausted",
        503 => "unavailable",
        _ => "internal",
    }
}

/// A boxed stream of template progress lines.
pub type TemplateLogStream = Pin<Box<dyn Stream<Item = Result<crate::TemplateLog>> + Send>>;

fn ndjson_events(resp: Response) -> EventStream {
    ndjson_lines(resp)
}

fn ndjson_lines<T: serde::de::DeserializeOwned + 'static>(
    resp: Response,
) -> Pin<Box<dyn Stream<Item = Result<T>> + Send>> {
    let url = resp.url().to_string();
    let bytes = resp
        .bytes_stream()
        .map_err(move |source| ClientError::Http {
            url: url.clone(),
            source,
        });
    Box::pin(NdjsonStream::<T> {
        inner: Box::pin(bytes),
        buf: BytesMut::new(),
        done: false,
        item: std::marker::PhantomData,
    })
}

/// Splits a byte stream into lines and parses each as a `T` (an [`ExecEvent`], a
/// [`crate::TemplateLog`]).
struct NdjsonStream<T> {
    inner: ByteStream,
    buf: BytesMut,
    done: bool,
    item: std::marker::PhantomData<fn() -> T>,
}

impl<T> NdjsonStream<T> {
    fn next_line(&mut self) -> Option<Bytes> {
        loop {
            let pos = self.buf.iter().position(|&b| b == b'\n')?;
            let line = self.buf.split_to(pos + 1).freeze();
            let line = line.slice(..pos);
            if !line.iter().all(u8::is_ascii_whitespace) {
                return Some(line);
            }
        }
    }
}

impl<T: serde::de::DeserializeOwned> Stream for NdjsonStream<T> {
    type Item = Result<T>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if let Some(line) = self.next_line() {
                return Poll::Ready(Some(parse_event(&line)));
            }
            if self.done {
                if self.buf.iter().all(u8::is_ascii_whitespace) {
                    return Poll::Ready(None);
                }
                let rest = self.buf.split().freeze();
                return Poll::Ready(Some(parse_event(&rest)));
            }
            match self.inner.as_mut().poll_next(cx) {
                Poll::Ready(Some(Ok(chunk))) => self.buf.extend_from_slice(&chunk),
                Poll::Ready(Some(Err(e))) => {
                    self.done = true;
                    self.buf.clear();
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => self.done = true,
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

fn parse_event<T: serde::de::DeserializeOwned>(line: &[u8]) -> Result<T> {
    serde_json::from_slice(line).map_err(|e| {
        ClientError::Decode(format!(
            "bad event line {:?}: {e}",
            String::from_utf8_lossy(line)
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn ndjson_splits_across_chunks() {
        let chunks: Vec<Result<Bytes>> = vec![
            Ok(Bytes::from_static(
                b"{\"type\":\"started\",\"pid\":1}\n{\"type\":\"std",
            )),
            Ok(Bytes::from_static(
                b"out\",\"offset\":0,\"data\":\"aGk=\"}\n\n",
            )),
            Ok(Bytes::from_static(b"{\"type\":\"exit\",\"code\":3}")),
        ];
        let s = NdjsonStream::<ExecEvent> {
            item: std::marker::PhantomData,
            inner: Box::pin(futures::stream::iter(chunks)),
            buf: BytesMut::new(),
            done: false,
        };
        let events: Vec<ExecEvent> = s.try_collect().await.unwrap();
        assert_eq!(
            events,
            vec![
                ExecEvent::Started { pid: 1 },
                ExecEvent::Stdout {
                    offset: 0,
                    data: b"hi".to_vec()
                },
                ExecEvent::Exit {
                    code: Some(3),
                    signal: None
                },
            ]
        );
    }

    #[tokio::test]
    async fn ndjson_reports_bad_lines() {
        let chunks: Vec<Result<Bytes>> = vec![Ok(Bytes::from_static(b"nope\n"))];
        let mut s = NdjsonStream::<ExecEvent> {
            item: std::marker::PhantomData,
            inner: Box::pin(futures::stream::iter(chunks)),
            buf: BytesMut::new(),
            done: false,
        };
        assert!(matches!(s.next().await, Some(Err(ClientError::Decode(_)))));
        assert!(s.next().await.is_none());
    }
}
