//! `/v1/sandboxes/{id}/exec` and `/processes/...`: exec, output from an offset, stdin,
//! signals, PTY resize.

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};

use crate::engine::ExecReply;
use axum::http::StatusCode;
use space_api::ExecRequest;
use space_api::OutputQuery;
use space_api::ProcessList;
use space_api::ResizeRequest;
use space_api::SignalRequest;
use space_api::Started;

use super::HResult;
use super::extract::*;
use crate::AppState;

pub(crate) async fn exec(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiJson(req): ApiJson<ExecRequest>,
) -> HResult<Response> {
    Ok(match s.engine.exec(&p.id, req).await? {
        ExecReply::Events(events) => {
            ndjson(crate::snapshot_policy::after_exec(&s.engine, &p.id, events))
        }
        ExecReply::Background(pid) => (StatusCode::CREATED, Json(Started { pid })).into_response(),
    })
}

pub(crate) async fn list_processes(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
) -> HResult<Json<ProcessList>> {
    Ok(Json(ProcessList {
        processes: s.engine.list_processes(&p.id).await?,
    }))
}

pub(crate) async fn process_output(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<PidPath>,
    ApiQuery(q): ApiQuery<OutputQuery>,
) -> HResult<Response> {
    let events = s
        .engine
        .process_output(&p.id, p.pid, q.offset, q.follow.unwrap_or(true))
        .await?;
    Ok(ndjson(events))
}

pub(crate) async fn write_stdin(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<PidPath>,
    ApiBytes(body): ApiBytes,
) -> HResult<StatusCode> {
    s.engine.write_stdin(&p.id, p.pid, body).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(crate) async fn close_stdin(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<PidPath>,
) -> HResult<StatusCode> {
    s.engine.close_stdin(&p.id, p.pid).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(crate) async fn signal(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<PidPath>,
    ApiJson(req): ApiJson<SignalRequest>,
) -> HResult<StatusCode> {
    s.engine.signal(&p.id, p.pid, req).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(crate) async fn resize(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<PidPath>,
    ApiJson(req): ApiJson<ResizeRequest>,
) -> HResult<StatusCode> {
    s.engine.resize(&p.id, p.pid, req.rows, req.cols).await?;
    Ok(StatusCode::NO_CONTENT)
}
