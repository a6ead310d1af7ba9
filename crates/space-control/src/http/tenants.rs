//! `/v1/tenants` and `/v1/keys` (decision 0040). Admin keys only (see `tenants::access`).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Deserialize;

use space_api::tenant::{
    ApiKeyList, CreateKey, CreateTenant, CreatedKey, RotateKey, SetTenant, Tenant, TenantList,
};

use super::HResult;
use super::extract::*;
use crate::AppState;

pub(crate) async fn create_tenant(
    State(s): State<AppState>,
    ApiJson(req): ApiJson<CreateTenant>,
) -> HResult<(StatusCode, Json<Tenant>)> {
    Ok((
        StatusCode::CREATED,
        Json(s.engine.create_tenant(req).await?),
    ))
}

pub(crate) async fn list_tenants(State(s): State<AppState>) -> HResult<Json<TenantList>> {
    Ok(Json(TenantList {
        tenants: s.engine.list_tenants().await?,
    }))
}

pub(crate) async fn set_tenant(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    ApiJson(req): ApiJson<SetTenant>,
) -> HResult<Json<Tenant>> {
    Ok(Json(s.engine.set_tenant(&p.id, req).await?))
}

pub(crate) async fn delete_tenant(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
) -> HResult<StatusCode> {
    s.engine.delete_tenant(&p.id).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(crate) async fn create_key(
    State(s): State<AppState>,
    ApiJson(req): ApiJson<CreateKey>,
) -> HResult<(StatusCode, Json<CreatedKey>)> {
    let created = s.auth.create_key(&s.engine.store, &req).await?;
    Ok((StatusCode::CREATED, Json(created)))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct KeyQuery {
    tenant: Option<String>,
}

pub(crate) async fn list_keys(
    State(s): State<AppState>,
    ApiQuery(q): ApiQuery<KeyQuery>,
) -> HResult<Json<ApiKeyList>> {
    Ok(Json(ApiKeyList {
        keys: s
            .auth
            .list_keys(&s.engine.store, q.tenant.as_deref())
            .await?,
    }))
}

pub(crate) async fn rotate_key(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
    body: axum::body::Bytes,
) -> HResult<(StatusCode, Json<CreatedKey>)> {
    let req: RotateKey = if body.iter().all(u8::is_ascii_whitespace) {
        RotateKey::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            crate::error::ControlError::invalid(format!("invalid rotate request: {e}"))
        })?
    };
    let created = s.auth.rotate_key(&s.engine.store, &p.id, &req).await?;
    Ok((StatusCode::CREATED, Json(created)))
}

pub(crate) async fn revoke_key(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<IdPath>,
) -> HResult<StatusCode> {
    s.auth.revoke_key(&s.engine.store, &p.id).await?;
    Ok(StatusCode::NO_CONTENT)
}
