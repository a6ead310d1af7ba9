//! Per-template settings: the runtime a template's creates get when they name none
//! (`PUT /v1/templates/{name}/settings`, `space template set NAME --runtime R`). The order a
//! create's runtime is decided in: the request's, the template's, the node's default.

use std::collections::HashMap;

use space_api::{SetTemplateSettings, Template};
use sqlx::Row;

use crate::engine::{Engine, RUNTIMES, template_dto};
use crate::error::{AppError, AppResult};
use crate::store::{Store, StoreError, now_ms};

fn q(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { what, source }
}

impl Store {
    /// Sets (Some) or clears (None) a template's default runtime.
    pub async fn put_template_runtime(
        &self,
        template: &str,
        runtime: Option<&str>,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO template_settings (template, runtime, updated_at) VALUES ($1, $2, $3) \
             ON CONFLICT (template) DO UPDATE SET runtime = excluded.runtime, \
             updated_at = excluded.updated_at",
        )
        .bind(template)
        .bind(runtime)
        .bind(now_ms())
        .execute(self.pool())
        .await
        .map_err(q("put template settings"))?;
        Ok(())
    }

    /// Every template's default runtime that is set.
    pub async fn template_runtimes(&self) -> Result<HashMap<String, String>, StoreError> {
        let rows = sqlx::query(
            "SELECT template, runtime FROM template_settings WHERE runtime IS NOT NULL",
        )
        .fetch_all(self.pool())
        .await
        .map_err(q("list template settings"))?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get::<String, _>("template")
                        .map_err(q("decode template settings"))?,
                    r.try_get::<String, _>("runtime")
                        .map_err(q("decode template settings"))?,
                ))
            })
            .collect()
    }

    /// A template's default runtime, when set.
    pub async fn template_runtime(&self, template: &str) -> Result<Option<String>, StoreError> {
        let row = sqlx::query("SELECT runtime FROM template_settings WHERE template = $1")
            .bind(template)
            .fetch_optional(self.pool())
            .await
            .map_err(q("get template settings"))?;
        match row {
            Some(r) => r
                .try_get::<Option<String>, _>("runtime")
                .map_err(q("decode template settings")),
            None => Ok(None),
        }
    }
}

impl Engine {
    /// The runtime a create of `template` that names none gets: the template's, else the
    /// node's default.
    pub(crate) async fn default_runtime_of(&self, template: &str) -> AppResult<String> {
        Ok(self
            .store
            .template_runtime(template)
            .await?
            .unwrap_or_else(|| self.cfg.default_runtime.clone()))
    }

    /// Sets a template's settings; answers the template as listed.
    pub async fn set_template_settings(
        &self,
        name: &str,
        req: SetTemplateSettings,
    ) -> AppResult<Template> {
        crate::pools::check_template(name)?;
        if let Some(r) = &req.runtime
            && !RUNTIMES.contains(&r.as_str())
        {
            return Err(AppError::invalid(format!(
                "unknown runtime {r:?}: expected one of {} (or null for the node's default)",
                RUNTIMES.join(", ")
            )));
        }
        let templates = self.node.list_templates().await?;
        let Some(t) = templates
            .iter()
            .filter(|t| t.name == name)
            .max_by_key(|t| t.version)
        else {
            return Err(AppError::not_found(format!("template {name} not found")));
        };
        self.store
            .put_template_runtime(name, req.runtime.as_deref())
            .await?;
        tracing::info!(template = name, runtime = ?req.runtime, "template settings set");
        let mut dto = template_dto(t);
        dto.runtime = req.runtime;
        Ok(dto)
    }
}
