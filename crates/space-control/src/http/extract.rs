//! Extractors whose rejections are the API's JSON errors (400, 413), and shared path types.
//! A leaf: it depends on nothing of the crate but the error type.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::{HeaderMap, StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use futures::stream::BoxStream;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::error::ControlError;

/// A JSON body (any content type), limited by `DefaultBodyLimit`.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ControlError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ControlError> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(body_rejection)?;
        if bytes.is_empty() {
            return Err(ControlError::invalid("a JSON request body is required"));
        }
        // serde would also accept a struct written as an array; the API takes objects only.
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(ControlError::invalid(
                "the request body must be a JSON object",
            ));
        }
        serde_json::from_slice(&bytes)
            .map(ApiJson)
            .map_err(|e| ControlError::invalid(format!("invalid JSON body: {e}")))
    }
}

/// A raw body (e.g. stdin bytes), limited by `DefaultBodyLimit`.
pub struct ApiBytes(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for ApiBytes {
    type Rejection = ControlError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ControlError> {
        Bytes::from_request(req, state)
            .await
            .map(ApiBytes)
            .map_err(body_rejection)
    }
}

fn body_rejection(r: axum::extract::rejection::BytesRejection) -> ControlError {
    if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ControlError::too_large("request body exceeds the size limit")
    } else {
        ControlError::invalid(format!("cannot read the request body: {}", r.body_text()))
    }
}

/// Query parameters.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ControlError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ControlError> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| ApiQuery(q.0))
            .map_err(|r| ControlError::invalid(format!("invalid query: {}", r.body_text())))
    }
}

/// Path parameters.
pub struct ApiPath<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ControlError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ControlError> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| ApiPath(p.0))
            .map_err(|r| ControlError::invalid(format!("invalid path: {}", r.body_text())))
    }
}

/// `{id}` of a route (one definition for every module's handlers).
#[derive(Debug, Deserialize)]
pub(crate) struct IdPath {
    pub(crate) id: String,
}

#[derive(Deserialize)]
pub(crate) struct PidPath {
    pub(crate) id: String,
    pub(crate) pid: u32,
}

#[derive(Deserialize)]
pub(crate) struct NamePath {
    pub(crate) name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PathOnly {
    pub(crate) path: String,
}

pub(crate) fn content_length(headers: &HeaderMap) -> Option<u64> {
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
