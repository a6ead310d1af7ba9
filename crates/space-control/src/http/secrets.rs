//! `/v1/secrets...`: the secrets of the key's own tenant (decision 0048).

use axum::Extension;
use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};

use axum::http::StatusCode;
use space_api::PutSecret;
use space_api::SecretInfo;
use space_api::SecretList;

use super::extract::*;
use crate::AppState;
use crate::error::ControlError;
use crate::tenants::Principal;
use serde::Deserialize;

#[derive(Deserialize)]
pub(crate) struct SecretPath {
    name: String,
}

pub(crate) async fn list_secrets(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
) -> Result<Json<SecretList>, ControlError> {
    Ok(Json(SecretList {
        secrets: s.engine.vault.list(&who.tenant).await?,
    }))
}

pub(crate) async fn get_secret(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiPath(p): ApiPath<SecretPath>,
) -> Result<Json<SecretInfo>, ControlError> {
    Ok(Json(s.engine.vault.get(&who.tenant, &p.name).await?))
}

pub(crate) async fn put_secret(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiPath(p): ApiPath<SecretPath>,
    ApiJson(req): ApiJson<PutSecret>,
) -> Result<Json<SecretInfo>, ControlError> {
    Ok(Json(s.engine.vault.put(&who.tenant, &p.name, &req).await?))
}

pub(crate) async fn delete_secret(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiPath(p): ApiPath<SecretPath>,
) -> Result<Response, ControlError> {
    s.engine.vault.delete(&who.tenant, &p.name).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
