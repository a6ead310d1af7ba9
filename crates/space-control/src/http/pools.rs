//! `/v1/pools` and `/v1/templates/{name}/pool`.

use axum::Json;
use axum::extract::State;

use space_api::Pool;
use space_api::PoolList;
use space_api::SetPool;

use super::extract::*;
use crate::AppState;
use crate::error::ControlError;

pub(crate) async fn list_pools(State(s): State<AppState>) -> Result<Json<PoolList>, ControlError> {
    Ok(Json(PoolList {
        pools: s.engine.list_pools().await,
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
