//! Per-template settings (`PUT /v1/templates/{name}/settings`, `space template set NAME`):
//! the runtime a template's creates get when they name none (the order a create's runtime is
//! decided in: the request's, the template's, the node's default), and the replicas they get
//! (decision 0037: the request's, the template's, else 0). The same row says whose template
//! the name is and whether other tenants may use it (decision 0048).

use std::collections::HashMap;

use space_api::tenant::DEFAULT_TENANT;
use space_api::{MAX_REPLICAS, SetTemplateSettings, Template};
use sqlx::Row;

use crate::convert::template_dto;
use crate::engine::{Engine, RUNTIMES};
use crate::error::{ControlError, ControlResult};
use crate::store::{Store, StoreError, now_ms};

fn q(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { what, source }
}

/// A template's settings as stored (absent row: all unset).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TemplateSettings {
    pub runtime: Option<String>,
    pub replicas: Option<u32>,
    /// Its tenant (None: `default`). Never changed by [`Store::put_template_settings`].
    pub tenant: Option<String>,
    /// Whether other tenants may use it (None: its owner's default).
    pub shared: Option<bool>,
}

impl TemplateSettings {
    /// The tenant the template belongs to.
    pub fn owner(&self) -> &str {
        self.tenant.as_deref().unwrap_or(DEFAULT_TENANT)
    }

    /// Whether every tenant may read it and create sandboxes of it: as set, else for
    /// `default`'s templates (the operator's catalogue) and for no other tenant's.
    pub fn is_shared(&self) -> bool {
        self.shared.unwrap_or(self.owner() == DEFAULT_TENANT)
    }

    /// Whether `tenant` may see it and create sandboxes of it.
    pub fn visible_to(&self, tenant: &str) -> bool {
        self.owner() == tenant || self.is_shared()
    }

    /// `dto` with these settings.
    pub fn apply(&self, dto: Template) -> Template {
        Template {
            runtime: self.runtime.clone(),
            replicas: self.replicas,
            tenant: self.owner().to_owned(),
            shared: self.is_shared(),
            ..dto
        }
    }
}

fn decode(r: &sqlx::any::AnyRow) -> Result<TemplateSettings, StoreError> {
    Ok(TemplateSettings {
        runtime: r
            .try_get::<Option<String>, _>("runtime")
            .map_err(q("decode template settings"))?,
        replicas: r
            .try_get::<Option<i64>, _>("replicas")
            .map_err(q("decode template settings"))?
            .map(|n| n.clamp(0, i64::from(u32::MAX)) as u32),
        tenant: r
            .try_get::<Option<String>, _>("tenant_id")
            .map_err(q("decode template settings"))?,
        shared: r
            .try_get::<Option<i64>, _>("shared")
            .map_err(q("decode template settings"))?
            .map(|n| n != 0),
    })
}

const COLUMNS: &str = "runtime, replicas, tenant_id, shared";

impl Store {
    /// Replaces a template's settings (all unset forgets them); its tenant stays.
    pub async fn put_template_settings(
        &self,
        template: &str,
        s: &TemplateSettings,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO template_settings (template, runtime, replicas, shared, updated_at) \
             VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (template) DO UPDATE SET runtime = excluded.runtime, \
             replicas = excluded.replicas, shared = excluded.shared, \
             updated_at = excluded.updated_at",
        )
        .bind(template)
        .bind(s.runtime.as_deref())
        .bind(s.replicas.map(i64::from))
        .bind(s.shared.map(i64::from))
        .bind(now_ms())
        .execute(self.pool())
        .await
        .map_err(q("put template settings"))?;
        Ok(())
    }

    /// Every template's settings that are stored.
    pub async fn all_template_settings(
        &self,
    ) -> Result<HashMap<String, TemplateSettings>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT template, {COLUMNS} FROM template_settings"
        ))
        .fetch_all(self.pool())
        .await
        .map_err(q("list template settings"))?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get::<String, _>("template")
                        .map_err(q("decode template settings"))?,
                    decode(r)?,
                ))
            })
            .collect()
    }

    /// A template's settings (all unset when none are stored).
    pub async fn template_settings(&self, template: &str) -> Result<TemplateSettings, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM template_settings WHERE template = $1"
        ))
        .bind(template)
        .fetch_optional(self.pool())
        .await
        .map_err(q("get template settings"))?;
        row.as_ref()
            .map(decode)
            .transpose()
            .map(Option::unwrap_or_default)
    }

    /// Makes `tenant` the owner of template name `template` unless another tenant is (a row
    /// with no tenant is settings left by a removed template of `default`'s: the caller has
    /// checked that no such template exists); answers the owner it has now.
    pub async fn claim_template(&self, template: &str, tenant: &str) -> Result<String, StoreError> {
        sqlx::query(
            "INSERT INTO template_settings (template, tenant_id, updated_at) VALUES ($1, $2, $3) \
             ON CONFLICT (template) DO UPDATE SET tenant_id = excluded.tenant_id \
             WHERE template_settings.tenant_id IS NULL",
        )
        .bind(template)
        .bind(tenant)
        .bind(now_ms())
        .execute(self.pool())
        .await
        .map_err(q("claim template"))?;
        Ok(self.template_settings(template).await?.owner().to_owned())
    }
}

impl Engine {
    /// `info` as the API shows it: with its stored settings (runtime, replicas, its tenant
    /// and whether it is shared).
    pub async fn template_out(
        &self,
        info: &space_node_api::TemplateInfo,
    ) -> ControlResult<Template> {
        Ok(self
            .store
            .template_settings(&info.name)
            .await?
            .apply(template_dto(info)))
    }

    /// The runtime a create of `template` that names none gets: the template's, else the
    /// node's default.
    pub(crate) async fn default_runtime_of(&self, template: &str) -> ControlResult<String> {
        Ok(self
            .store
            .template_settings(template)
            .await?
            .runtime
            .unwrap_or_else(|| self.cfg.default_runtime.clone()))
    }

    /// Checks a number of replicas asked for (a create's or a template's): at most
    /// [`MAX_REPLICAS`], and only where there are other nodes to keep them.
    pub(crate) fn check_replicas(&self, replicas: u32) -> ControlResult<()> {
        if replicas > MAX_REPLICAS {
            return Err(ControlError::invalid(format!(
                "replicas {replicas}: at most {MAX_REPLICAS} replica is kept for now \
                 (decision 0037)"
            )));
        }
        if replicas > 0 && self.cluster_nodes.is_none() {
            return Err(ControlError::invalid(
                "replicas need a cluster: this spaced runs all-in-one, with one node, and a \
                 replica is kept on another node (run `spaced control` with joined nodes; \
                 decision 0037)",
            ));
        }
        Ok(())
    }

    /// Sets a template's settings, replaced whole; answers the template as listed.
    pub async fn set_template_settings(
        &self,
        name: &str,
        req: SetTemplateSettings,
    ) -> ControlResult<Template> {
        crate::pools::check_template(name)?;
        if let Some(r) = &req.runtime
            && !RUNTIMES.contains(&r.as_str())
        {
            return Err(ControlError::invalid(format!(
                "unknown runtime {r:?}: expected one of {} (or null for the node's default)",
                RUNTIMES.join(", ")
            )));
        }
        self.check_replicas(req.replicas.unwrap_or(0))?;
        let templates = self.node.list_templates().await?;
        let Some(t) = templates
            .iter()
            .filter(|t| t.name == name)
            .max_by_key(|t| t.version)
        else {
            return Err(ControlError::not_found(format!(
                "template {name} not found"
            )));
        };
        let settings = TemplateSettings {
            runtime: req.runtime,
            replicas: req.replicas.filter(|n| *n > 0),
            shared: req.shared,
            ..self.store.template_settings(name).await?
        };
        self.store.put_template_settings(name, &settings).await?;
        tracing::info!(template = name, ?settings, "template settings set");
        Ok(settings.apply(template_dto(t)))
    }
}
