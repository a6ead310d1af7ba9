//! The control plane's domain error. Every engine operation returns a [`ControlError`]: a
//! [`ErrorKind`] that callers match on, and a message safe to show a client. Internal details
//! go to the log. What a kind means on the wire (an HTTP status, a Connect code) is decided
//! by the transport that answers: `http::error` for the REST API, the E2B modules for theirs.

use space_api::ErrorBody;
use space_node_api::NodeError;

use crate::store::StoreError;

/// What went wrong, as callers tell errors apart. Never match on the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The request is malformed or names something impossible.
    InvalidArgument,
    /// No credential, or not a valid one.
    Unauthorized,
    /// A valid credential that may not do this.
    PermissionDenied,
    /// The object does not exist (or is not the caller's to see).
    NotFound,
    /// The object exists but is in a state that forbids the operation.
    Conflict,
    /// A precondition the caller set (or the guest checked) does not hold.
    FailedPrecondition,
    /// A read beyond the end (an offset past what a file or stream holds).
    OutOfRange,
    /// A payload over its size limit.
    PayloadTooLarge,
    /// A node ran out of something (disk, slots, ids).
    ResourceExhausted,
    /// The tenant's quota does not allow it (the message names the quota).
    QuotaExceeded,
    /// The key's request rate is used up; retry later.
    RateLimited,
    /// A dependency (the database, a node, a guest) is not answering now; retry.
    Unavailable,
    /// A server-side failure; the detail is in the log.
    Internal,
}

impl ErrorKind {
    /// Whether the request itself is at fault (it names something that does not exist, or
    /// is malformed, or comes at the wrong time): the same request again fails the same way.
    /// The others are the server's or a dependency's, and a retry may succeed.
    pub fn is_caller_error(self) -> bool {
        !matches!(
            self,
            Self::ResourceExhausted | Self::Unavailable | Self::Internal | Self::RateLimited
        )
    }

    /// The stable code clients see in an error body.
    pub fn code(self) -> &'static str {
        match self {
            Self::InvalidArgument => "invalid_argument",
            Self::Unauthorized => "unauthorized",
            Self::PermissionDenied => "permission_denied",
            Self::NotFound => "not_found",
            Self::Conflict => "conflict",
            Self::FailedPrecondition => "failed_precondition",
            Self::OutOfRange => "out_of_range",
            Self::PayloadTooLarge => "payload_too_large",
            Self::ResourceExhausted => "resource_exhausted",
            Self::QuotaExceeded => "quota_exceeded",
            Self::RateLimited => "rate_limited",
            Self::Unavailable => "unavailable",
            Self::Internal => "internal",
        }
    }
}

/// The code of an error response, kept in its extensions (for the audit trail and metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorCode(pub &'static str);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlError {
    pub kind: ErrorKind,
    pub message: String,
}

impl std::fmt::Display for ControlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.code())
    }
}

impl std::error::Error for ControlError {}

pub type ControlResult<T> = Result<T, ControlError>;

impl ControlError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// The stable code clients see ([`ErrorKind::code`]).
    pub fn code(&self) -> &'static str {
        self.kind.code()
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unauthorized, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, message)
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Conflict, message)
    }

    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::PayloadTooLarge, message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unavailable, message)
    }

    /// A server-side failure: `detail` is logged, the client sees a generic message.
    pub fn internal(detail: impl std::fmt::Display) -> Self {
        tracing::error!(error = %detail, "internal error");
        Self::new(
            ErrorKind::Internal,
            "internal error (details in the server log)",
        )
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody::new(self.code(), self.message.clone())
    }
}

impl From<NodeError> for ControlError {
    fn from(e: NodeError) -> Self {
        match &e {
            NodeError::NotFound { .. } => Self::not_found(e.to_string()),
            NodeError::InvalidArgument(_) => Self::invalid(e.to_string()),
            NodeError::Conflict(_) | NodeError::WrongPhase { .. } => Self::conflict(e.to_string()),
            NodeError::Exhausted(_) => Self::new(ErrorKind::ResourceExhausted, e.to_string()),
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

impl From<tonic::Status> for ControlError {
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
            Code::FailedPrecondition => Self::new(ErrorKind::FailedPrecondition, msg),
            Code::OutOfRange => Self::new(ErrorKind::OutOfRange, msg),
            Code::PermissionDenied => Self::new(ErrorKind::PermissionDenied, msg),
            Code::ResourceExhausted => Self::new(ErrorKind::ResourceExhausted, msg),
            Code::Unavailable => {
                tracing::warn!(status = ?s, "guest unavailable");
                Self::unavailable("the sandbox's guest is not answering")
            }
            // A guest call past its deadline (space_node_api::guest::deadline_of).
            Code::DeadlineExceeded => Self::unavailable(msg),
            _ => Self::internal(format_args!("guest rpc failed: {s:?}")),
        }
    }
}

impl From<StoreError> for ControlError {
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
    use ErrorKind::*;

    #[test]
    fn a_database_that_does_not_answer_is_unavailable() {
        let down = StoreError::Query {
            what: "x",
            source: sqlx::Error::PoolTimedOut,
        };
        assert_eq!(ControlError::from(down).kind, Unavailable);
        let refused = StoreError::Query {
            what: "x",
            source: sqlx::Error::RowNotFound,
        };
        let e = ControlError::from(refused);
        assert_eq!((e.kind, e.code()), (Internal, "internal"));
    }

    #[test]
    fn tonic_codes_map_to_kinds() {
        let cases = [
            (tonic::Code::NotFound, NotFound),
            (tonic::Code::InvalidArgument, InvalidArgument),
            (tonic::Code::AlreadyExists, Conflict),
            (tonic::Code::FailedPrecondition, FailedPrecondition),
            (tonic::Code::OutOfRange, OutOfRange),
            (tonic::Code::PermissionDenied, PermissionDenied),
            (tonic::Code::Unavailable, Unavailable),
            (tonic::Code::DeadlineExceeded, Unavailable),
            (tonic::Code::ResourceExhausted, ResourceExhausted),
            (tonic::Code::Internal, Internal),
            (tonic::Code::Unknown, Internal),
        ];
        for (code, kind) in cases {
            let e = ControlError::from(tonic::Status::new(code, "secret detail /run/x"));
            assert_eq!(e.kind, kind, "{code:?}");
        }
        // Messages of client-facing codes pass through; internal ones do not.
        let e = ControlError::from(tonic::Status::not_found("no such file: /x"));
        assert_eq!(e.message, "no such file: /x");
        let e = ControlError::from(tonic::Status::internal("secret detail"));
        assert!(!e.message.contains("secret"));
        let e = ControlError::from(tonic::Status::unavailable("socket /run/space/x"));
        assert!(!e.message.contains("/run"));
    }

    #[test]
    fn node_errors_map_to_kinds_with_the_same_codes() {
        let cases: Vec<(NodeError, ErrorKind)> = vec![
            (
                NodeError::NotFound {
                    kind: "template",
                    id: "x".into(),
                },
                NotFound,
            ),
            (NodeError::InvalidArgument("x".into()), InvalidArgument),
            (NodeError::Conflict("x".into()), Conflict),
            (
                NodeError::WrongPhase {
                    id: "x".into(),
                    phase: space_node_api::Phase::Paused,
                },
                Conflict,
            ),
            (NodeError::Exhausted("x".into()), ResourceExhausted),
            (
                NodeError::Unavailable {
                    id: "x".into(),
                    reason: "gone".into(),
                },
                Unavailable,
            ),
            (NodeError::Internal("/secret/path".into()), Internal),
        ];
        for (e, kind) in cases {
            let code = e.code();
            let a = ControlError::from(e);
            assert_eq!((a.kind, a.code()), (kind, code));
            assert!(!a.message.contains("/secret"));
        }
    }
}
