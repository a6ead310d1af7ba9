//! `/v1/nodes` and `/v1/cluster`.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use space_api::{ClusterStatus, CreateJoinToken, JoinToken, NodeList};

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
