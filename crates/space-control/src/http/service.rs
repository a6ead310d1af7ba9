//! `/healthz`, `/metrics` and `/v1/e2b`.

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};

use space_api::Health;

use super::HResult;
use crate::AppState;
use axum::http::header;

pub(crate) async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        version: env!("CARGO_PKG_VERSION").into(),
    })
}

pub(crate) async fn e2b_settings(State(s): State<AppState>) -> Json<space_api::E2bSettings> {
    let cfg = s.engine.config();
    Json(space_api::E2bSettings {
        domain: cfg.e2b_domain.clone(),
        ca: cfg.e2b_ca_pem.clone(),
    })
}

pub(crate) async fn metrics(State(s): State<AppState>) -> HResult<Response> {
    let text = s.engine.metrics_text().await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}
