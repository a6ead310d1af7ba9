//! `/v1/sandboxes` and a sandbox's lifecycle: create, list, get, delete, pause, resume,
//! timeout, snapshot policy, events and metrics.

use axum::Extension;
use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};

use axum::http::StatusCode;
use space_api::MetricsQuery;
use space_api::Sandbox;
use space_api::SandboxList;
use space_api::SandboxMetrics;
use space_api::SetTimeout;
use space_api::SnapshotPolicy;

use super::HResult;
use super::extract::*;
use crate::AppState;
use crate::error::ControlError;
use crate::tenants::Principal;
use crate::usage::bound;

/// `POST /v1/sandboxes`: 201 with the new sandbox; with an `Idempotency-Key` an earlier
/// try made, 200 with that try's sandbox and `Idempotent-Replayed: true`.
pub(crate) async fn create_sandbox(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    headers: axum::http::HeaderMap,
    ApiJson(req): ApiJson<space_api::CreateSandbox>,
) -> HResult<Response> {
    let key = match headers.get("idempotency-key") {
        None => None,
        Some(v) => Some(v.to_str().map_err(|_| {
            ControlError::invalid("Idempotency-Key must be visible ASCII characters")
        })?),
    };
    let (sb, replayed) = s.engine.create_sandbox_keyed(&who.tenant, req, key).await?;
    Ok(if replayed {
        (StatusCode::OK, [("idempotent-replayed", "true")], Json(sb)).into_response()
    } else {
        (StatusCode::CREATED, Json(sb)).into_response()
    })
}

pub(crate) async fn list_sandboxes(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
) -> HResult<Json<SandboxList>> {
    Ok(Json(SandboxList {
        sandboxes: s.engine.list_sandboxes(who.list_filter()).await?,
    }))
}

pub(crate) async fn get_sandbox(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
) -> HResult<Json<space_api::Sandbox>> {
    Ok(Json(s.engine.get_sandbox(&p.id).await?))
}

pub(crate) async fn delete_sandbox(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
) -> HResult<StatusCode> {
    s.engine.delete_sandbox(&p.id).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(crate) async fn pause(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    body: axum::body::Bytes,
) -> Result<Json<Sandbox>, ControlError> {
    let req: space_api::PauseRequest = if body.iter().all(u8::is_ascii_whitespace) {
        Default::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ControlError::invalid(format!("invalid pause request: {e}")))?
    };
    Ok(Json(if req.memory == Some(false) {
        s.engine.stop_sandbox(&p.id).await?
    } else {
        s.engine.pause_sandbox(&p.id).await?
    }))
}

pub(crate) async fn resume(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
) -> Result<Json<Sandbox>, ControlError> {
    Ok(Json(s.engine.resume_sandbox(&p.id).await?))
}

pub(crate) async fn set_timeout(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiJson(req): ApiJson<SetTimeout>,
) -> Result<Json<Sandbox>, ControlError> {
    Ok(Json(s.engine.set_timeout(&p.id, req).await?))
}

pub(crate) async fn set_snapshot_policy(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiJson(req): ApiJson<SnapshotPolicy>,
) -> Result<Json<Sandbox>, ControlError> {
    Ok(Json(s.engine.set_snapshot_policy(&p.id, req).await?))
}

/// `GET /v1/sandboxes/{id}/events?limit=N&after=ID`.
pub(crate) async fn list_events(
    axum::extract::State(state): axum::extract::State<crate::AppState>,
    axum::extract::Path(id): axum::extract::Path<String>,
    crate::http::ApiQuery(q): crate::http::ApiQuery<space_api::EventQuery>,
) -> Result<axum::Json<space_api::EventList>, crate::ControlError> {
    let events = state.engine.list_events(&id, q).await?;
    Ok(axum::Json(space_api::EventList { events }))
}

pub(crate) async fn metrics(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiQuery(q): ApiQuery<MetricsQuery>,
) -> Result<Json<SandboxMetrics>, ControlError> {
    let since = bound("since", q.since.as_deref())?;
    let until = bound("until", q.until.as_deref())?;
    Ok(Json(s.engine.sandbox_metrics(&p.id, since, until).await?))
}
