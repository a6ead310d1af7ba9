//! The Connect protocol, server side, JSON codec only: what envd speaks to the E2B SDKs
//! (decision 0022 says why it is written here rather than taken from a crate).
//!
//! - **Unary:** `POST`, `Content-Type: application/json`, the message as the body; the reply
//!   is the message (200) or an error: an HTTP status with `{"code": "<name>", "message"}`.
//! - **Streaming** (server, client): `Content-Type: application/connect+json`; each message
//!   is an envelope `[flags u8][length u32 BE][JSON]`. A reply ends with an envelope flagged
//!   [`END_STREAM`] holding `{}` or `{"error": {...}}`, always with HTTP 200.
//! - `Connect-Timeout-Ms` bounds a call. Compression is refused (the SDKs send none).

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::stream::{BoxStream, Stream, StreamExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{ControlError, ErrorCode, ErrorKind};

/// Flag of a compressed envelope (refused).
pub const COMPRESSED: u8 = 0x01;
/// Flag of the envelope that ends a stream.
pub const END_STREAM: u8 = 0x02;
/// Largest message accepted in one envelope or unary body.
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

pub const UNARY_CONTENT_TYPE: &str = "application/json";
pub const STREAM_CONTENT_TYPE: &str = "application/connect+json";

/// Connect's error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    pub fn name(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code (the Connect spec's table).
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::Unknown | Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
                StatusCode::BAD_REQUEST
            }
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// An error as Connect carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.name(), "message": self.message})
    }
}

impl From<ControlError> for ConnectError {
    fn from(e: ControlError) -> Self {
        let code = match e.kind {
            ErrorKind::InvalidArgument => Code::InvalidArgument,
            ErrorKind::Unauthorized => Code::Unauthenticated,
            ErrorKind::PermissionDenied => Code::PermissionDenied,
            ErrorKind::NotFound => Code::NotFound,
            ErrorKind::Conflict | ErrorKind::FailedPrecondition => Code::FailedPrecondition,
            ErrorKind::OutOfRange => Code::OutOfRange,
            ErrorKind::PayloadTooLarge
            | ErrorKind::ResourceExhausted
            | ErrorKind::QuotaExceeded
            | ErrorKind::RateLimited => Code::ResourceExhausted,
            ErrorKind::Unavailable => Code::Unavailable,
            ErrorKind::Internal => Code::Internal,
        };
        Self::new(code, e.message)
    }
}

/// A unary error reply.
impl IntoResponse for ConnectError {
    fn into_response(self) -> Response {
        let mut resp = (
            self.code.http_status(),
            [(header::CONTENT_TYPE, UNARY_CONTENT_TYPE)],
            self.json().to_string(),
        )
            .into_response();
        resp.extensions_mut().insert(ErrorCode(self.code.name()));
        resp
    }
}

fn content_type(headers: &HeaderMap) -> &str {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or("").trim())
        .unwrap_or("")
}

fn refuse_compression(headers: &HeaderMap, name: &str) -> Result<(), ConnectError> {
    match headers.get(name).and_then(|v| v.to_str().ok()) {
        None | Some("identity") => Ok(()),
        Some(other) => Err(ConnectError::new(
            Code::Unimplemented,
            format!("compression {other:?} is not supported; send identity"),
        )),
    }
}

fn decode<T: DeserializeOwned>(json: &[u8]) -> Result<T, ConnectError> {
    // An empty body is the empty message.
    let json: &[u8] = if json.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        json
    };
    serde_json::from_slice(json).map_err(|e| ConnectError::invalid(format!("invalid message: {e}")))
}

/// The message of a unary request.
pub fn unary_request<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: &[u8],
) -> Result<T, ConnectError> {
    match content_type(headers) {
        UNARY_CONTENT_TYPE => {}
        "application/proto" => {
            return Err(ConnectError::new(
                Code::Unimplemented,
                "the protobuf codec is not supported; send application/json",
            ));
        }
        other => {
            return Err(ConnectError::invalid(format!(
                "unary calls take Content-Type {UNARY_CONTENT_TYPE}, not {other:?}"
            )));
        }
    }
    refuse_compression(headers, "content-encoding")?;
    if body.len() > MAX_MESSAGE_BYTES {
        return Err(ConnectError::new(
            Code::ResourceExhausted,
            format!("message exceeds {MAX_MESSAGE_BYTES} bytes"),
        ));
    }
    decode(body)
}

/// A unary reply.
pub fn unary_reply<T: Serialize>(msg: &T) -> Response {
    match serde_json::to_vec(msg) {
        Ok(json) => ([(header::CONTENT_TYPE, UNARY_CONTENT_TYPE)], json).into_response(),
        Err(e) => ConnectError::from(ControlError::internal(e)).into_response(),
    }
}

/// Checks a streaming request's headers.
pub fn check_stream_headers(headers: &HeaderMap) -> Result<(), ConnectError> {
    match content_type(headers) {
        STREAM_CONTENT_TYPE => {}
        "application/connect+proto" => {
            return Err(ConnectError::new(
                Code::Unimplemented,
                "the protobuf codec is not supported; send application/connect+json",
            ));
        }
        other => {
            return Err(ConnectError::invalid(format!(
                "streaming calls take Content-Type {STREAM_CONTENT_TYPE}, not {other:?}"
            )));
        }
    }
    refuse_compression(headers, "connect-content-encoding")
}

/// Splits one envelope off the front of `buf`: `Ok(None)` while it is incomplete.
pub fn split_envelope(buf: &mut bytes::BytesMut) -> Result<Option<(u8, Bytes)>, ConnectError> {
    if buf.len() < 5 {
        return Ok(None);
    }
    let flags = buf[0];
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if len > MAX_MESSAGE_BYTES {
        return Err(ConnectError::new(
            Code::ResourceExhausted,
            format!("message of {len} bytes exceeds {MAX_MESSAGE_BYTES}"),
        ));
    }
    if flags & COMPRESSED != 0 {
        return Err(ConnectError::new(
            Code::Unimplemented,
            "compressed messages are not supported",
        ));
    }
    if buf.len() < 5 + len {
        return Ok(None);
    }
    let mut frame = buf.split_to(5 + len);
    let _ = frame.split_to(5);
    Ok(Some((flags, frame.freeze())))
}

/// The one message of a server-streaming request (its whole body).
pub fn stream_request<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: &[u8],
) -> Result<T, ConnectError> {
    check_stream_headers(headers)?;
    let mut buf = bytes::BytesMut::from(body);
    let Some((flags, msg)) = split_envelope(&mut buf)? else {
        return Err(ConnectError::invalid(
            "malformed envelope: the body ends inside it",
        ));
    };
    if flags & END_STREAM != 0 || !buf.is_empty() {
        return Err(ConnectError::invalid(
            "a server-streaming call takes exactly one message",
        ));
    }
    decode(&msg)
}

/// The messages of a client-streaming request, decoded as they arrive.
pub fn request_messages<T: DeserializeOwned + Send + 'static>(
    body: Body,
) -> BoxStream<'static, Result<T, ConnectError>> {
    struct St {
        body: axum::body::BodyDataStream,
        buf: bytes::BytesMut,
        done: bool,
    }
    let st = St {
        body: body.into_data_stream(),
        buf: bytes::BytesMut::new(),
        done: false,
    };
    futures::stream::unfold(st, |mut st| async move {
        loop {
            if st.done {
                return None;
            }
            match split_envelope(&mut st.buf) {
                Err(e) => {
                    st.done = true;
                    return Some((Err(e), st));
                }
                Ok(Some((flags, _))) if flags & END_STREAM != 0 => return None,
                Ok(Some((_, msg))) => return Some((decode(&msg), st)),
                Ok(None) => {}
            }
            match st.body.next().await {
                Some(Ok(chunk)) => st.buf.extend_from_slice(&chunk),
                Some(Err(e)) => {
                    st.done = true;
                    let err = ConnectError::new(Code::Canceled, format!("request body: {e}"));
                    return Some((Err(err), st));
                }
                None => {
                    st.done = true;
                    if st.buf.is_empty() {
                        return None;
                    }
                    let err = ConnectError::invalid("malformed envelope: the body ends inside it");
                    return Some((Err(err), st));
                }
            }
        }
    })
    .boxed()
}

/// One envelope.
pub fn envelope(flags: u8, json: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + json.len());
    out.push(flags);
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(json);
    out.into()
}

/// The envelope that ends a stream, with `error` if it failed.
pub fn end_of_stream(error: Option<&ConnectError>) -> Bytes {
    let body = match error {
        Some(e) => serde_json::json!({"error": e.json()}),
        None => serde_json::json!({}),
    };
    envelope(END_STREAM, body.to_string().as_bytes())
}

/// A streaming reply: each message in an envelope, flushed as it comes, then the end of the
/// stream, which carries the first error (the stream stops there).
pub fn stream_reply<T, S>(messages: S) -> Response
where
    T: Serialize + Send + 'static,
    S: Stream<Item = Result<T, ConnectError>> + Send + 'static,
{
    let body = futures::stream::unfold(Some(messages.boxed()), |st| async move {
        let mut messages = st?;
        let frame = match messages.next().await {
            Some(Ok(msg)) => match serde_json::to_vec(&msg) {
                Ok(json) => return Some((envelope(0, &json), Some(messages))),
                Err(e) => end_of_stream(Some(&ConnectError::from(ControlError::internal(e)))),
            },
            Some(Err(e)) => end_of_stream(Some(&e)),
            None => end_of_stream(None),
        };
        Some((frame, None))
    })
    .map(Ok::<_, Infallible>);
    stream_response(Body::from_stream(body))
}

/// A streaming reply that is only an error.
pub fn stream_error(e: ConnectError) -> Response {
    stream_response(Body::from(end_of_stream(Some(&e))))
}

fn stream_response(body: Body) -> Response {
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(STREAM_CONTENT_TYPE),
    );
    resp
}

/// `Connect-Timeout-Ms`: at most 10 digits, as the spec says.
pub fn timeout(headers: &HeaderMap) -> Result<Option<Duration>, ConnectError> {
    let Some(v) = headers.get("connect-timeout-ms") else {
        return Ok(None);
    };
    let text = v.to_str().unwrap_or("");
    if text.is_empty() || text.len() > 10 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ConnectError::invalid(format!(
            "invalid Connect-Timeout-Ms {text:?}"
        )));
    }
    Ok(Some(Duration::from_millis(
        text.parse().unwrap_or(u64::MAX),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(ct: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, ct.parse().unwrap());
        h
    }

    #[test]
    fn envelopes_split_whole_and_wait_for_the_rest() {
        let a = envelope(0, br#"{"a":1}"#);
        let b = envelope(END_STREAM, b"{}");
        let mut buf = bytes::BytesMut::new();
        buf.extend_from_slice(&a[..3]);
        assert_eq!(split_envelope(&mut buf).unwrap(), None);
        buf.extend_from_slice(&a[3..]);
        buf.extend_from_slice(&b);
        let (f, m) = split_envelope(&mut buf).unwrap().unwrap();
        assert_eq!((f, &m[..]), (0, &br#"{"a":1}"#[..]));
        let (f, m) = split_envelope(&mut buf).unwrap().unwrap();
        assert_eq!((f, &m[..]), (END_STREAM, &b"{}"[..]));
        assert!(buf.is_empty());
    }

    #[test]
    fn bad_envelopes_are_refused_with_their_reason() {
        let mut huge = bytes::BytesMut::from(&[0u8, 0xff, 0xff, 0xff, 0xff][..]);
        assert_eq!(
            split_envelope(&mut huge).unwrap_err().code,
            Code::ResourceExhausted
        );
        let mut compressed = bytes::BytesMut::from(&envelope(COMPRESSED, b"{}")[..]);
        assert_eq!(
            split_envelope(&mut compressed).unwrap_err().code,
            Code::Unimplemented
        );
        let h = headers(STREAM_CONTENT_TYPE);
        let cut = envelope(0, b"{}");
        let e = stream_request::<serde_json::Value>(&h, &cut[..4]).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        let two = [envelope(0, b"{}"), envelope(0, b"{}")].concat();
        let e = stream_request::<serde_json::Value>(&h, &two).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        let e = stream_request::<serde_json::Value>(&headers("text/plain"), &cut).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        let e = stream_request::<serde_json::Value>(&h, &envelope(0, b"{nope")).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
    }

    #[test]
    fn unary_takes_json_and_an_empty_body_is_the_empty_message() {
        let h = headers("application/json; charset=utf-8");
        let v: serde_json::Value = unary_request(&h, b"").unwrap();
        assert_eq!(v, serde_json::json!({}));
        let e = unary_request::<serde_json::Value>(&headers("application/proto"), b"").unwrap_err();
        assert_eq!(e.code, Code::Unimplemented);
    }

    #[test]
    fn errors_map_to_connect_codes_and_statuses() {
        let e = ConnectError::from(ControlError::not_found("x"));
        assert_eq!(
            (e.code, e.code.http_status()),
            (Code::NotFound, StatusCode::NOT_FOUND)
        );
        let e = ConnectError::from(ControlError::conflict("x"));
        assert_eq!(e.code, Code::FailedPrecondition);
        let end = end_of_stream(Some(&e));
        assert_eq!(end[0], END_STREAM);
        let v: serde_json::Value = serde_json::from_slice(&end[5..]).unwrap();
        assert_eq!(v["error"]["code"], "failed_precondition");
    }

    #[test]
    fn timeouts_are_milliseconds_of_at_most_ten_digits() {
        let mut h = HeaderMap::new();
        assert_eq!(timeout(&h).unwrap(), None);
        h.insert("connect-timeout-ms", "60000".parse().unwrap());
        assert_eq!(timeout(&h).unwrap(), Some(Duration::from_secs(60)));
        h.insert("connect-timeout-ms", "12345678901".parse().unwrap());
        assert!(timeout(&h).is_err());
        h.insert("connect-timeout-ms", "-1".parse().unwrap());
        assert!(timeout(&h).is_err());
    }
}
