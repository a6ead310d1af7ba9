//! `/v1/sandboxes/{id}/snapshots`, rollback, fork and diff.

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};

use axum::http::StatusCode;
use space_api::CreateSnapshot;
use space_api::DiffList;
use space_api::ForkRequest;
use space_api::RollbackRequest;
use space_api::Sandbox;
use space_api::SandboxList;
use space_api::SnapshotList;

use super::extract::*;
use crate::AppState;
use crate::error::ControlError;
use crate::snapshots::optional_body;
use serde::Deserialize;

#[derive(Debug, Deserialize)]
pub(crate) struct DiffPath {
    id: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DiffQuery {
    from: Option<String>,
    to: Option<String>,
}

#[derive(Deserialize)]
pub(crate) struct SnapPath {
    id: String,
    snap: String,
}

pub(crate) async fn create_snapshot(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiBytes(body): ApiBytes,
) -> Result<Response, ControlError> {
    let req: CreateSnapshot = optional_body(&body)?;
    let snap = s.engine.create_snapshot(&p.id, req).await?;
    Ok((StatusCode::CREATED, Json(snap)).into_response())
}

pub(crate) async fn list_snapshots(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
) -> Result<Json<SnapshotList>, ControlError> {
    let snapshots = s.engine.list_snapshots(&p.id).await?;
    Ok(Json(SnapshotList {
        snapshots,
        head: s.engine.snapshot_head(&p.id).await?,
        forks: s.engine.snapshot_forks(&p.id).await?,
    }))
}

pub(crate) async fn delete_snapshot(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<SnapPath>,
) -> Result<StatusCode, ControlError> {
    s.engine.delete_snapshot(&p.id, &p.snap).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(crate) async fn rollback(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiJson(req): ApiJson<RollbackRequest>,
) -> Result<Json<Sandbox>, ControlError> {
    Ok(Json(s.engine.rollback(&p.id, req).await?))
}

pub(crate) async fn fork(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiBytes(body): ApiBytes,
) -> Result<Response, ControlError> {
    let req: ForkRequest = optional_body(&body)?;
    let sandboxes = s.engine.fork(&p.id, req).await?;
    Ok((StatusCode::CREATED, Json(SandboxList { sandboxes })).into_response())
}

pub(crate) async fn diff(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<DiffPath>,
    ApiQuery(q): ApiQuery<DiffQuery>,
) -> Result<Json<DiffList>, ControlError> {
    let changes = s
        .engine
        .diff(&p.id, q.from.as_deref(), q.to.as_deref())
        .await?;
    Ok(Json(DiffList { changes }))
}
