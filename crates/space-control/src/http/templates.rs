//! `/v1/templates...`: list, import, pull, build, show, remove, settings, start command,
//! from a snapshot.

use axum::Extension;
use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};

use axum::body::Body;
use axum::extract::RawQuery;
use axum::http::HeaderMap;
use axum::http::StatusCode;
use serde::Deserialize;
use space_api::PullTemplate;
use space_api::SetTemplateSettings;
use space_api::Template;
use space_api::TemplateFromSnapshot;
use space_api::TemplateList;

use super::HResult;
use super::extract::*;
use crate::AppState;
use crate::build::BuildOptions;
use crate::error::ControlError;
use crate::tenants::Principal;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RemoveQuery {
    version: Option<u32>,
}

/// The templates the key's tenant may use (every one for an admin key). The auth middleware
/// has checked a template route's access ([`crate::tenants::authorize`]).
pub(crate) async fn list_templates(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
) -> HResult<Json<TemplateList>> {
    let mut templates = s.engine.list_templates(who.list_filter()).await?;
    for t in &mut templates {
        operator_only(&who, t);
    }
    Ok(Json(TemplateList { templates }))
}

/// Drops what only an operator should see of a template: its host path.
fn operator_only(who: &Principal, t: &mut Template) {
    if !who.is_admin() {
        t.path = None;
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ImportQuery {
    #[serde(default)]
    replace: bool,
}

pub(crate) async fn import_template(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<NamePath>,
    ApiQuery(q): ApiQuery<ImportQuery>,
    headers: HeaderMap,
    body: Body,
) -> HResult<Response> {
    let t = s
        .engine
        .import_template(
            &p.name,
            q.replace,
            content_length(&headers),
            body.into_data_stream(),
        )
        .await?;
    Ok((StatusCode::CREATED, Json(t)).into_response())
}

pub(crate) async fn set_template_settings(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<NamePath>,
    ApiJson(req): ApiJson<SetTemplateSettings>,
) -> Result<Json<Template>, ControlError> {
    Ok(Json(s.engine.set_template_settings(&p.name, req).await?))
}

pub(crate) async fn get_template(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiPath(p): ApiPath<NamePath>,
) -> Result<axum::Json<space_api::TemplateDetail>, ControlError> {
    let mut t = s.engine.get_template(&p.name).await?;
    for v in &mut t.versions {
        operator_only(&who, v);
    }
    Ok(axum::Json(t))
}

pub(crate) async fn remove_template(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<NamePath>,
    crate::http::ApiQuery(q): crate::http::ApiQuery<RemoveQuery>,
) -> Result<axum::Json<space_api::TemplateRemoved>, ControlError> {
    Ok(axum::Json(
        s.engine.remove_template(&p.name, q.version).await?,
    ))
}

pub(crate) async fn set_template_start(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<NamePath>,
    ApiJson(req): ApiJson<space_api::SetTemplateStart>,
) -> Result<axum::Json<space_api::Template>, ControlError> {
    Ok(axum::Json(s.engine.set_template_start(&p.name, req).await?))
}

pub(crate) async fn pull_template(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<NamePath>,
    ApiJson(req): ApiJson<PullTemplate>,
) -> Result<Response, ControlError> {
    Ok(crate::http::ndjson(
        s.engine.pull_template(&p.name, req).await?,
    ))
}

pub(crate) async fn build_template(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiPath(p): ApiPath<NamePath>,
    RawQuery(q): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ControlError> {
    let opts = BuildOptions::from_query(q.as_deref())?;
    let len = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let lines = s
        .engine
        .build_template(
            &p.name,
            who.list_filter(),
            opts,
            len,
            body.into_data_stream(),
        )
        .await?;
    Ok(crate::http::ndjson(lines))
}

pub(crate) async fn template_from_snapshot(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiPath(p): ApiPath<crate::http::NamePath>,
    ApiJson(req): ApiJson<TemplateFromSnapshot>,
) -> Result<Response, ControlError> {
    // The snapshot must be of one of the key's tenant's sandboxes (another's is not found).
    if !who.is_admin()
        && s.engine
            .owners
            .tenant_of(&s.engine.store, &req.sandbox)
            .await?
            .is_none_or(|t| t != who.tenant)
    {
        return Err(ControlError::not_found(format!(
            "sandbox {} not found",
            req.sandbox
        )));
    }
    let t = s.engine.template_from_snapshot(&p.name, req).await?;
    Ok((StatusCode::CREATED, Json(t)).into_response())
}
