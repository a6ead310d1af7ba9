//! The one error type of the HTTP layer. Clients see a stable code and a safe message;
//! internal details go to the log.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use space_api::ErrorBody;
use space_node_api::NodeError;

use crate::store::StoreError;

/// The code of an error response, kept in its extensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorCode(pub &'static str);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl std::fmt::Display for AppError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.code)
    }
}

impl std::error::Error for AppError {}

pub type AppResult<T> = Result<T, AppError>;

impl AppError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_argument", message)
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", message)
    }

    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
    }

    /// A server-side failure: `detail` is logged, the client sees a generic message.
    pub fn internal(detail: impl std::fmt::Display) -> Self {
        tracing::error!(error = %detail, "internal error");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "internal error (details in the server log)",
        )
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody::new(self.code, self.message.clone())
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Json(self.body())).into_response();
        // For the audit middleware (see `events`).
        resp.extensions_mut().insert(ErrorCode(self.code));
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        // Every 503 is a wait (a database or guest not answering now): say when to try again.
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

impl From<NodeError> for AppError {
    fn from(e: NodeError) -> Self {
        match &e {
            NodeError::NotFound { .. } => Self::not_found(e.to_string()),
            NodeError::InvalidArgument(_) => Self::invalid(e.to_string()),
            NodeError::Conflict(_) | NodeError::WrongPhase { .. } => Self::conflict(e.to_string()),
            NodeError::Exhausted(_) => Self::new(
                StatusCode::INSUFFICIENT_STORAGE,
                "resource_exhausted",
                e.to_string(),
            ),
            NodeError::Unavailable { id, .. } => {
                tracing::warn!(error = %e, "guest unavailable");
                Self::unavailable(format!("the guest of sandbox {id} is not answering"))
            }
            NodeError::NotReady { .. } | NodeError::Unreachable { .. } => {
                Self::unavailable(e.to_string())
            }
            NodeError::Internal(_) => Self::internal(&e),
        }
    }
}

impl From<tonic::Status> for AppError {
    fn from(s: tonic::Status) -> Self {
        use tonic::Code;
        // A node agent's own answer to a guest call it forwards (the sandbox is not there,
        // or paused) reads as the same error in-process would be.
        if let Some(e) = space_rpc::wire::node_error_in(&s) {
            return e.into();
        }
        let msg = s.message().to_string();
        match s.code() {
            Code::NotFound => Self::not_found(msg),
            Code::InvalidArgument => Self::invalid(msg),
            Code::AlreadyExists => Self::conflict(msg),
            Code::FailedPrecondition => {
                Self::new(StatusCode::PRECONDITION_FAILED, "failed_precondition", msg)
            }
            Code::OutOfRange => Self::new(StatusCode::RANGE_NOT_SATISFIABLE, "out_of_range", msg),
            Code::PermissionDenied => Self::new(StatusCode::FORBIDDEN, "permission_denied", msg),
            Code::ResourceExhausted => {
                Self::new(StatusCode::INSUFFICIENT_STORAGE, "resource_exhausted", msg)
            }
            Code::Unavailable => {
                tracing::warn!(status = ?s, "guest unavailable");
                Self::unavailable("the sandbox's guest is not answering")
            }
            _ => Self::internal(format_args!("guest rpc failed: {s:?}")),
        }
    }
}

impl From<StoreError> for AppError {
    fn from(e: StoreError) -> Self {
        if e.is_unavailable() {
            tracing::warn!(error = %crate::error_chain(&e), "the database is not answering");
            return Self::unavailable("the database is not answering; try again in a moment");
        }
        Self::internal(format_args!("store: {}", crate::error_chain(&e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_database_that_does_not_answer_is_a_503_to_retry() {
        let down = StoreError::Query {
            what: "x",
            source: sqlx::Error::PoolTimedOut,
        };
        let e = AppError::from(down);
        assert_eq!((e.status.as_u16(), e.code), (503, "unavailable"));
        let resp = e.into_response();
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
        let refused = StoreError::Query {
            what: "x",
            source: sqlx::Error::RowNotFound,
        };
        let e = AppError::from(refused);
        assert_eq!((e.status.as_u16(), e.code), (500, "internal"));
        assert!(
            e.into_response()
                .headers()
                .get(header::RETRY_AFTER)
                .is_none()
        );
    }

    #[test]
    fn tonic_codes_map_to_statuses() {
        let cases = [
            (tonic::Code::NotFound, 404, "not_found"),
            (tonic::Code::InvalidArgument, 400, "invalid_argument"),
            (tonic::Code::AlreadyExists, 409, "conflict"),
            (tonic::Code::FailedPrecondition, 412, "failed_precondition"),
            (tonic::Code::OutOfRange, 416, "out_of_range"),
            (tonic::Code::PermissionDenied, 403, "permission_denied"),
            (tonic::Code::Unavailable, 503, "unavailable"),
            (tonic::Code::ResourceExhausted, 507, "resource_exhausted"),
            (tonic::Code::Internal, 500, "internal"),
            (tonic::Code::Unknown, 500, "internal"),
        ];
        for (code, status, name) in cases {
            let e = AppError::from(tonic::Status::new(code, "secret detail /run/x"));
            assert_eq!(e.status.as_u16(), status, "{code:?}");
            assert_eq!(e.code, name, "{code:?}");
        }
        // Messages of client-facing codes pass through; internal ones do not.
        let e = AppError::from(tonic::Status::not_found("no such file: /x"));
        assert_eq!(e.message, "no such file: /x");
        let e = AppError::from(tonic::Status::internal("secret detail"));
        assert!(!e.message.contains("secret"));
        let e = AppError::from(tonic::Status::unavailable("socket /run/space/x"));
        assert!(!e.message.contains("/run"));
    }

    #[test]
    fn node_errors_map_to_statuses() {
        let cases: Vec<(NodeError, u16, &str)> = vec![
            (
                NodeError::NotFound {
                    kind: "template",
                    id: "x".into(),
                },
                404,
                "not_found",
            ),
            (
                NodeError::InvalidArgument("x".into()),
                400,
                "invalid_argument",
            ),
            (NodeError::Conflict("x".into()), 409, "conflict"),
            (
                NodeError::WrongPhase {
                    id: "x".into(),
                    phase: space_node_api::Phase::Paused,
                },
                409,
                "conflict",
            ),
            (NodeError::Exhausted("x".into()), 507, "resource_exhausted"),
            (
                NodeError::Unavailable {
                    id: "x".into(),
                    reason: "gone".into(),
                },
                503,
                "unavailable",
            ),
            (NodeError::Internal("/secret/path".into()), 500, "internal"),
        ];
        for (e, status, code) in cases {
            assert_eq!(e.code(), code);
            let a = AppError::from(e);
            assert_eq!(a.status.as_u16(), status);
            assert_eq!(a.code, code);
            assert!(!a.message.contains("/secret"));
        }
    }
}
