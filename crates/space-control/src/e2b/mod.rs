//! The E2B facade (decision 0022): E2B's control API and envd's API on spaced's own address,
//! so that agent code written against the official `e2b` SDKs runs on space unchanged.
//!
//! - [`control`]: `/v2/sandboxes...` and `/sandboxes...`, routed by path beside `/v1`, with
//!   the key in `X-API-KEY` (either form, see [`space_api::e2b_key`]) and E2B's error body
//!   `{"code": <status>, "message": ...}`.
//! - [`envd`]: every request that carries `E2b-Sandbox-Id`, chosen by [`dispatch`] before any
//!   path routing, checked against the sandbox's envd access token, and served over the
//!   sandbox's space-daemon channel. [`connect`] is the Connect protocol codec it speaks.
//! - [`host`]: with `spaced --e2b-domain`, E2B's host form (`PORT-ID.DOMAIN`) routed onto
//!   the same headers (decision 0030).

pub mod connect;
pub mod control;
pub mod envd;
pub mod files;
pub mod host;
pub mod pb;
pub mod secrets;
pub mod watch;

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::error::{ControlError, ErrorCode};

/// The envd version space answers with. The SDKs gate features on it: 0.3.0 stdin, 0.4.0
/// the default user, 0.5.2 close_stdin, 0.5.7 octet-stream uploads, 0.6.2 file metadata
/// (`user.e2b.*` extended attributes) and 0.6.3 entries in watch events, all served. The next
/// gate (0.6.4, watches on network mounts) is not, so the SDKs refuse that option themselves.
pub const ENVD_VERSION: &str = "0.6.3";

/// The port the SDKs name in `E2b-Sandbox-Port` for envd.
pub const ENVD_PORT: u16 = 49983;

/// The header that sends a request to envd.
pub const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";
/// The port of the sandbox a request is for (envd's, or another one to pass on).
pub const SANDBOX_PORT_HEADER: &str = "e2b-sandbox-port";

/// Whether `path` is one of E2B's control paths (their errors take E2B's shape).
pub fn is_control_path(path: &str) -> bool {
    path == "/sandboxes"
        || path.starts_with("/sandboxes/")
        || path == "/v2/sandboxes"
        || path.starts_with("/v2/sandboxes/")
        || path == "/snapshots"
        || path.starts_with("/templates/")
        || path == "/secrets"
        || path.starts_with("/secrets/")
}

/// An [`ControlError`] answered in E2B's shape: `{"code": <HTTP status>, "message": ...}`.
#[derive(Debug)]
pub struct E2bError(pub ControlError);

impl From<ControlError> for E2bError {
    fn from(e: ControlError) -> Self {
        Self(e)
    }
}

impl From<crate::store::StoreError> for E2bError {
    fn from(e: crate::store::StoreError) -> Self {
        Self(e.into())
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let status = self.0.http_status();
        let body = serde_json::json!({
            "code": status.as_u16(),
            "message": self.0.message,
        });
        let mut resp = (status, Json(body)).into_response();
        resp.extensions_mut().insert(ErrorCode(self.0.code()));
        resp
    }
}

/// E2B's answer for a sandbox that is not there: for envd calls, its proxy's 502 (the SDKs
/// turn it into `SandboxNotRunningException` / `is_running() == False`).
pub(crate) fn sandbox_gone(id: &str) -> Response {
    let body = serde_json::json!({
        "code": 502,
        "message": format!("The sandbox {id} was not found"),
        "sandboxId": id,
    });
    (StatusCode::BAD_GATEWAY, Json(body)).into_response()
}

pub use envd::dispatch;
