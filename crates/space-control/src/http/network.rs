//! `/v1/sandboxes/{id}/network` and `/ports`.

use axum::Json;
use axum::extract::State;

use axum::http::HeaderMap;
use axum::http::Uri;
use space_api::NetworkPolicy;
use space_api::PortInfo;
use space_api::PortRequest;
use space_api::Sandbox;

use super::extract::*;
use crate::AppState;
use crate::error::ControlError;
use axum::http::header;

pub(crate) async fn set_network(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiJson(req): ApiJson<NetworkPolicy>,
) -> Result<Json<Sandbox>, ControlError> {
    Ok(Json(s.engine.set_network(&p.id, req).await?))
}

pub(crate) async fn open_port(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    uri: Uri,
    headers: HeaderMap,
    ApiJson(req): ApiJson<PortRequest>,
) -> Result<Json<PortInfo>, ControlError> {
    // HTTP/1.1 sends Host; HTTP/2 the URI's authority.
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| uri.authority().map(|a| a.to_string()));
    Ok(Json(
        s.engine.open_port(&p.id, req.port, host.as_deref()).await?,
    ))
}
