//! What a [`ControlError`] is on the REST API: its HTTP status, its JSON body, and the
//! headers that come with some statuses.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use space_api::ErrorBody;

use crate::error::{ControlError, ErrorCode, ErrorKind};

/// The HTTP status of an error kind.
pub fn status(kind: ErrorKind) -> StatusCode {
    match kind {
        ErrorKind::InvalidArgument => StatusCode::BAD_REQUEST,
        ErrorKind::Unauthorized => StatusCode::UNAUTHORIZED,
        ErrorKind::PermissionDenied => StatusCode::FORBIDDEN,
        ErrorKind::NotFound => StatusCode::NOT_FOUND,
        ErrorKind::Conflict => StatusCode::CONFLICT,
        ErrorKind::FailedPrecondition => StatusCode::PRECONDITION_FAILED,
        ErrorKind::OutOfRange => StatusCode::RANGE_NOT_SATISFIABLE,
        ErrorKind::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        ErrorKind::ResourceExhausted => StatusCode::INSUFFICIENT_STORAGE,
        ErrorKind::QuotaExceeded => StatusCode::FORBIDDEN,
        ErrorKind::RateLimited => StatusCode::TOO_MANY_REQUESTS,
        ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl ControlError {
    /// The HTTP status this error is answered with ([`status`]).
    pub fn http_status(&self) -> StatusCode {
        status(self.kind)
    }
}

/// An error response in the API's shape, for the few answers that are HTTP's own (a method
/// not allowed, a port URL whose upstream does not answer) rather than a domain error.
pub fn response(status: StatusCode, code: &'static str, message: impl Into<String>) -> Response {
    let mut resp = (status, Json(ErrorBody::new(code, message))).into_response();
    resp.extensions_mut().insert(ErrorCode(code));
    if status == StatusCode::UNAUTHORIZED {
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    // Every 503 is a wait (a database or guest not answering now): say when to try again.
    if status == StatusCode::SERVICE_UNAVAILABLE {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    resp
}

impl IntoResponse for ControlError {
    fn into_response(self) -> Response {
        response(self.http_status(), self.code(), self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreError;

    #[test]
    fn a_database_that_does_not_answer_is_a_503_to_retry() {
        let down = StoreError::Query {
            what: "x",
            source: sqlx::Error::PoolTimedOut,
        };
        let resp = ControlError::from(down).into_response();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
        assert_eq!(
            resp.extensions().get::<ErrorCode>(),
            Some(&ErrorCode("unavailable"))
        );
        let resp = ControlError::internal("x").into_response();
        assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(resp.headers().get(header::RETRY_AFTER).is_none());
    }

    #[test]
    fn an_unauthorized_answer_names_the_scheme() {
        let resp = ControlError::unauthorized("no key").into_response();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(resp.headers()[header::WWW_AUTHENTICATE], "Bearer");
    }

    #[test]
    fn node_errors_keep_their_statuses() {
        use space_node_api::NodeError;
        let cases: Vec<(NodeError, u16)> = vec![
            (NodeError::InvalidArgument("x".into()), 400),
            (NodeError::Conflict("x".into()), 409),
            (NodeError::Exhausted("x".into()), 507),
            (NodeError::Internal("x".into()), 500),
        ];
        for (e, code) in cases {
            assert_eq!(ControlError::from(e).http_status().as_u16(), code);
        }
        let cases = [
            (tonic::Code::FailedPrecondition, 412),
            (tonic::Code::OutOfRange, 416),
            (tonic::Code::PermissionDenied, 403),
        ];
        for (code, status) in cases {
            let e = ControlError::from(tonic::Status::new(code, "x"));
            assert_eq!(e.http_status().as_u16(), status, "{code:?}");
        }
    }
}
