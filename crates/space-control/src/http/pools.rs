//! `/v1/pools` and `/v1/templates/{name}/pool`: a pool is its template's tenant's
//! (decision 0048; the auth middleware checks a template's pool, the list is filtered here).

use axum::extract::State;
use axum::{Extension, Json};

use space_api::Pool;
use space_api::PoolList;
use space_api::SetPool;

use super::extract::*;
use crate::AppState;
use crate::error::ControlError;
use crate::tenants::Principal;

/// The pools of the key's tenant's templates (every pool for an admin key).
pub(crate) async fn list_pools(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
) -> Result<Json<PoolList>, ControlError> {
    Ok(Json(PoolList {
        pools: s.engine.list_pools(who.list_filter()).await?,
    }))
}

pub(crate) async fn get_pool(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<NamePath>,
) -> Result<Json<Pool>, ControlError> {
    Ok(Json(s.engine.get_pool(&p.name).await?))
}

pub(crate) async fn set_pool(
    State(s): State<AppState>,
    ApiPath(p): ApiPath<NamePath>,
    ApiJson(req): ApiJson<SetPool>,
) -> Result<Json<Pool>, ControlError> {
    Ok(Json(s.engine.set_pool(&p.name, req).await?))
}
