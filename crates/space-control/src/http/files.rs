//! `/v1/sandboxes/{id}/files...`.

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};

use axum::body::Body;
use axum::http::HeaderMap;
use axum::http::StatusCode;
use space_api::EntryList;
use space_api::MakeDirRequest;
use space_api::PathQuery;
use space_api::RenameRequest;
use space_api::WriteFileQuery;

use super::HResult;
use super::extract::*;
use crate::AppState;
use axum::http::header;

pub(crate) async fn read_file(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiQuery(q): ApiQuery<PathOnly>,
) -> HResult<Response> {
    let stream = s.engine.read_file(&p.id, &q.path).await?;
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Body::from_stream(stream),
    )
        .into_response())
}

pub(crate) async fn write_file(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiQuery(q): ApiQuery<WriteFileQuery>,
    headers: HeaderMap,
    body: Body,
) -> HResult<Json<space_api::EntryInfo>> {
    let entry = s
        .engine
        .write_file(
            &p.id,
            q,
            Default::default(),
            content_length(&headers),
            body.into_data_stream(),
        )
        .await?;
    Ok(Json(entry))
}

pub(crate) async fn remove_file(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> HResult<StatusCode> {
    s.engine.remove_file(&p.id, q).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(crate) async fn stat(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiQuery(q): ApiQuery<PathOnly>,
) -> HResult<Json<space_api::EntryInfo>> {
    Ok(Json(s.engine.stat(&p.id, &q.path).await?))
}

pub(crate) async fn watch_files(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiQuery(q): ApiQuery<space_api::WatchQuery>,
) -> HResult<Response> {
    Ok(ndjson(s.engine.watch(&p.id, &q.path, q.recursive).await?))
}

pub(crate) async fn list_dir(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> HResult<Json<EntryList>> {
    Ok(Json(EntryList {
        entries: s.engine.list_dir(&p.id, q).await?,
    }))
}

pub(crate) async fn mkdir(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiJson(req): ApiJson<MakeDirRequest>,
) -> HResult<Response> {
    let e = s.engine.mkdir(&p.id, req).await?;
    Ok((StatusCode::CREATED, Json(e)).into_response())
}

pub(crate) async fn rename(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiJson(req): ApiJson<RenameRequest>,
) -> HResult<Json<space_api::EntryInfo>> {
    Ok(Json(s.engine.rename(&p.id, req).await?))
}
