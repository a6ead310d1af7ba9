//! `/v1/nodes`, `/v1/cluster`, and a sandbox's move between nodes.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use space_api::{
    ClusterStatus, CreateJoinToken, Drain, JoinToken, MigrateRequest, Migration, NodeList,
};

use super::HResult;
use super::extract::{ApiJson, ApiPath, IdPath};
use crate::AppState;

pub(crate) async fn list_nodes(State(s): State<AppState>) -> HResult<Json<NodeList>> {
    Ok(Json(NodeList {
        nodes: s.engine.list_nodes().await?,
    }))
}

pub(crate) async fn cluster_status(State(s): State<AppState>) -> HResult<Json<ClusterStatus>> {
    Ok(Json(s.engine.cluster_status().await?))
}

pub(crate) async fn create_token(
    State(s): State<AppState>,
    ApiJson(req): ApiJson<CreateJoinToken>,
) -> HResult<(StatusCode, Json<JoinToken>)> {
    let ttl = req
        .ttl_secs
        .map_or(crate::cluster::TOKEN_TTL, std::time::Duration::from_secs);
    Ok((
        StatusCode::CREATED,
        Json(s.engine.create_join_token(ttl).await?),
    ))
}

pub(crate) async fn remove_node(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
) -> HResult<StatusCode> {
    s.engine.remove_node(&p.id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/sandboxes/{id}/migrate`: an empty body lets the scheduler choose the node.
pub(crate) async fn migrate(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    body: axum::body::Bytes,
) -> HResult<Json<Migration>> {
    let req: MigrateRequest = if body.iter().all(u8::is_ascii_whitespace) {
        MigrateRequest::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            crate::error::ControlError::invalid(format!("invalid migrate request: {e}"))
        })?
    };
    Ok(Json(s.engine.migrate_sandbox(&p.id, req).await?))
}

/// `POST /v1/nodes/{id}/drain`: nothing new goes to the node; answers its sandboxes.
pub(crate) async fn drain(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
) -> HResult<Json<Drain>> {
    Ok(Json(s.engine.drain_node(&p.id, true).await?))
}

/// `DELETE /v1/nodes/{id}/drain`: the node takes new sandboxes again.
pub(crate) async fn undrain(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
) -> HResult<Json<Drain>> {
    Ok(Json(s.engine.drain_node(&p.id, false).await?))
}
