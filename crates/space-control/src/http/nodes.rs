//! `/v1/nodes` and `/v1/cluster`.

use axum::Json;
use axum::extract::State;
use space_api::{ClusterStatus, NodeList};

use super::HResult;
use crate::AppState;

pub(crate) async fn list_nodes(State(s): State<AppState>) -> HResult<Json<NodeList>> {
    Ok(Json(NodeList {
        nodes: s.engine.list_nodes().await?,
    }))
}

pub(crate) async fn cluster_status(State(s): State<AppState>) -> HResult<Json<ClusterStatus>> {
    Ok(Json(s.engine.cluster_status().await?))
}
