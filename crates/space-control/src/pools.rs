//! Warm pools (decision 0013), control-plane side: the API over the node's pools, the sizes
//! users asked for (table `template_pools`, migration 0008), and [`Engine::restore_pools`],
//! which hands them to the node again when spaced starts.
//!
//! The node owns the pools themselves (building, handing out, refilling) and clamps sizes to
//! its capacity; the store keeps the *requested* sizes, so a node with more capacity after a
//! restart gets closer to them. A template without a row has no pool, except `base`, which
//! gets [`ControlConfig::default_pool`](crate::ControlConfig::default_pool) (spaced's
//! `--warm-pool`) until a user sets its pool (to 0 as well).

use space_api::tenant::DEFAULT_TENANT;
use space_api::{Pool, SetPool, is_valid_template_name};
use space_node_api::{PoolConfig, PoolStatus};
use sqlx::Row;

use crate::engine::{Engine, MICROVM, RUNTIME_NAME, RUNTIMES};

/// The runtime name a pool configuration stores.
fn runtime_of(cfg: &PoolConfig) -> &'static str {
    if cfg.microvm { MICROVM } else { RUNTIME_NAME }
}
use crate::error::{ControlError, ControlResult};
use crate::store::{Store, StoreError, now_ms};

/// A template's requested pool sizes, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRow {
    pub template: String,
    pub min: u32,
    pub max: u32,
    pub runtime: String,
    pub updated_at: i64,
}

fn q(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { what, source }
}

fn decode(r: &sqlx::any::AnyRow) -> Result<PoolRow, StoreError> {
    let template: String = r.try_get("template").map_err(q("decode pool"))?;
    let size = |col: &str, v: i64| {
        u32::try_from(v).map_err(|_| StoreError::Corrupt {
            id: template.clone(),
            reason: format!("pool {col} {v} is out of range"),
        })
    };
    let min = size("min", r.try_get("min").map_err(q("decode pool"))?)?;
    let max = size("max", r.try_get("max").map_err(q("decode pool"))?)?;
    Ok(PoolRow {
        min,
        max,
        runtime: r.try_get("runtime").map_err(q("decode pool"))?,
        updated_at: r.try_get("updated_at").map_err(q("decode pool"))?,
        template,
    })
}

impl Store {
    /// Creates or replaces a template's pool sizes.
    pub async fn put_pool(&self, row: &PoolRow) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO template_pools (template, min, max, runtime, updated_at) \
             VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (template) DO UPDATE SET min = excluded.min, max = excluded.max, \
             runtime = excluded.runtime, updated_at = excluded.updated_at",
        )
        .bind(&row.template)
        .bind(i64::from(row.min))
        .bind(i64::from(row.max))
        .bind(&row.runtime)
        .bind(row.updated_at)
        .execute(self.pool())
        .await
        .map_err(q("put pool"))?;
        Ok(())
    }

    /// Every stored pool, by template name.
    pub async fn list_pools(&self) -> Result<Vec<PoolRow>, StoreError> {
        let rows = sqlx::query(
            "SELECT template, min, max, runtime, updated_at FROM template_pools ORDER BY template",
        )
        .fetch_all(self.pool())
        .await
        .map_err(q("list pools"))?;
        rows.iter().map(decode).collect()
    }

    pub async fn get_pool(&self, template: &str) -> Result<Option<PoolRow>, StoreError> {
        let row = sqlx::query(
            "SELECT template, min, max, runtime, updated_at FROM template_pools \
             WHERE template = $1",
        )
        .bind(template)
        .fetch_optional(self.pool())
        .await
        .map_err(q("get pool"))?;
        row.as_ref().map(decode).transpose()
    }
}

/// The public form of a node's pool.
pub fn pool_dto(s: PoolStatus) -> Pool {
    Pool {
        template: s.template,
        runtime: s.runtime.to_string(),
        min: s.min,
        max: s.max,
        target: s.target,
        ready: s.ready,
        starting: s.starting,
        hits: s.hits,
        misses: s.misses,
        warning: s.warning,
    }
}

pub(crate) fn check_template(name: &str) -> ControlResult<()> {
    if is_valid_template_name(name) {
        Ok(())
    } else {
        Err(ControlError::invalid(format!(
            "invalid template name {name:?}: expected [a-z0-9][a-z0-9._-]{{0,62}}"
        )))
    }
}

/// Checks a request's sizes and runtime; `max` defaults to `min`, the runtime to
/// `default_runtime` (the template's, else the node's).
pub fn validate_set_pool(req: &SetPool, default_runtime: &str) -> ControlResult<PoolConfig> {
    let max = req.max.unwrap_or(req.min);
    if req.min > max {
        return Err(ControlError::invalid(format!(
            "min ({}) must not exceed max ({max})",
            req.min
        )));
    }
    let runtime = req.runtime.as_deref().unwrap_or(default_runtime);
    if !RUNTIMES.contains(&runtime) {
        return Err(ControlError::invalid(format!(
            "unknown runtime {runtime:?}: expected one of {}",
            RUNTIMES.join(", ")
        )));
    }
    Ok(PoolConfig {
        min: req.min,
        max,
        microvm: runtime == MICROVM,
    })
}

impl Engine {
    async fn require_template(&self, template: &str) -> ControlResult<()> {
        let known = self.node.list_templates().await?;
        if known.iter().any(|t| t.name == template) {
            Ok(())
        } else {
            Err(ControlError::not_found(format!(
                "template {template} not found"
            )))
        }
    }

    /// Sets a template's pool on the node and stores the requested sizes. The answer is the
    /// node's view: sizes clamped to its capacity, with a `warning` when they were.
    ///
    /// A pool of a tenant's template (not `default`'s) is charged to that tenant's quota: its
    /// `max` members count as sandboxes at the default limits (decision 0048).
    pub async fn set_pool(&self, template: &str, req: SetPool) -> ControlResult<Pool> {
        check_template(template)?;
        let cfg = validate_set_pool(&req, &self.default_runtime_of(template).await?)?;
        // One writer of pools at a time: a PUT never races the start-up restore.
        let _guard = self.pools_lock.lock().await;
        self.require_template(template).await?;
        let owner = self.store.template_settings(template).await?;
        if owner.tenant.is_some() {
            self.check_pool_quota(owner.owner(), template, cfg.max)
                .await?;
        }
        let status = self.node.set_pool(template, cfg).await?;
        if let Some(w) = &status.warning {
            tracing::warn!(
                template,
                min = cfg.min,
                max = cfg.max,
                warning = %w,
                "warm pool clamped"
            );
        }
        self.store
            .put_pool(&PoolRow {
                template: template.to_string(),
                min: cfg.min,
                max: cfg.max,
                runtime: runtime_of(&cfg).to_string(),
                updated_at: now_ms(),
            })
            .await?;
        tracing::info!(
            template,
            min = cfg.min,
            max = cfg.max,
            in_force_min = status.min,
            in_force_max = status.max,
            "warm pool set"
        );
        Ok(pool_dto(status))
    }

    /// A template's pool as the node reports it; a stored pool the node does not report
    /// (e.g. it failed to apply at start) is shown with its requested sizes and nothing
    /// ready.
    pub async fn get_pool(&self, template: &str) -> ControlResult<Pool> {
        check_template(template)?;
        if let Some(s) = self
            .node
            .pools()
            .await
            .into_iter()
            .find(|p| p.template == template)
        {
            return Ok(pool_dto(s));
        }
        if let Some(row) = self.store.get_pool(template).await? {
            return Ok(Pool {
                template: row.template,
                runtime: row.runtime,
                min: row.min,
                max: row.max,
                ..Pool::default()
            });
        }
        self.require_template(template).await?;
        Err(ControlError::not_found(format!(
            "template {template} has no warm pool"
        )))
    }

    /// Every pool the node keeps, by template name; of `tenant`'s templates only (every
    /// one: None).
    pub async fn list_pools(&self, tenant: Option<&str>) -> ControlResult<Vec<Pool>> {
        let mut list: Vec<Pool> = self.node.pools().await.into_iter().map(pool_dto).collect();
        if let Some(tenant) = tenant {
            let settings = self.store.all_template_settings().await?;
            list.retain(|p| {
                settings
                    .get(&p.template)
                    .map_or(DEFAULT_TENANT, |s| s.owner())
                    == tenant
            });
        }
        list.sort_by(|a, b| a.template.cmp(&b.template));
        Ok(list)
    }

    /// At start: hands every stored pool to the node again, then, when `base` has no stored
    /// pool, applies the configured default to it (not stored: a later `--warm-pool` change
    /// applies). Failures are logged; they never stop spaced.
    pub async fn restore_pools(&self) {
        let _guard = self.pools_lock.lock().await;
        let rows = match self.store.list_pools().await {
            Ok(rows) => rows,
            Err(e) => {
                // Whether `base` was turned off is unknown: apply no default either.
                tracing::error!(error = %crate::error_chain(&e), "cannot read the warm pools");
                return;
            }
        };
        for row in &rows {
            if !RUNTIMES.contains(&row.runtime.as_str()) {
                tracing::warn!(
                    template = %row.template,
                    runtime = %row.runtime,
                    "warm pool of an unknown runtime skipped"
                );
                continue;
            }
            let cfg = PoolConfig {
                min: row.min,
                max: row.max,
                microvm: row.runtime == MICROVM,
            };
            self.push_pool(&row.template, cfg, "stored").await;
        }
        let default = self.cfg.default_template.as_str();
        if !rows.iter().any(|r| r.template == default)
            && let Some(cfg) = self.cfg.default_pool
        {
            self.push_pool(default, cfg, "default").await;
        }
    }

    /// The start of every reconcile pass: a node seen for the first time, or started again
    /// since the last pass (its `started_unix_ms` changed), holds no pool settings yet; it
    /// gets them ([`Self::restore_pools`]). A node that does not answer is left for the next
    /// pass.
    pub(crate) async fn pools_pass(&self) {
        let Ok(info) = self.node.node_info().await else {
            return;
        };
        let before = self
            .node_started
            .swap(info.started_unix_ms, std::sync::atomic::Ordering::Relaxed);
        if before != info.started_unix_ms {
            if before != 0 {
                tracing::info!("the node agent restarted: handing it its warm pools again");
            }
            self.restore_pools().await;
        }
    }

    async fn push_pool(&self, template: &str, cfg: PoolConfig, origin: &'static str) {
        match self.node.set_pool(template, cfg).await {
            Ok(s) => {
                if let Some(w) = &s.warning {
                    tracing::warn!(template, origin, warning = %w, "warm pool clamped");
                }
                tracing::info!(
                    template,
                    origin,
                    min = s.min,
                    max = s.max,
                    "warm pool restored"
                );
            }
            Err(e) => tracing::warn!(
                template,
                origin,
                min = cfg.min,
                max = cfg.max,
                error = %e,
                "cannot restore the warm pool"
            ),
        }
    }
}

// ---- HTTP ----

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_runtime_are_validated() {
        let ok = |min, max: Option<u32>| {
            validate_set_pool(
                &SetPool {
                    min,
                    max,
                    runtime: None,
                },
                "namespace",
            )
        };
        let cfg = |min, max| PoolConfig {
            min,
            max,
            microvm: false,
        };
        assert_eq!(ok(3, None).unwrap(), cfg(3, 3));
        assert_eq!(ok(0, None).unwrap(), cfg(0, 0));
        assert_eq!(ok(2, Some(9)).unwrap(), cfg(2, 9));
        let e = ok(5, Some(3)).unwrap_err();
        assert_eq!(
            (e.http_status().as_u16(), e.code()),
            (400, "invalid_argument")
        );
        assert!(
            e.message.contains("min (5)") && e.message.contains("max (3)"),
            "{e}"
        );
        let with = |rt: Option<&str>, default: &str| {
            validate_set_pool(
                &SetPool {
                    min: 1,
                    max: None,
                    runtime: rt.map(str::to_owned),
                },
                default,
            )
        };
        let e = with(Some("firecracker"), "namespace").unwrap_err();
        assert_eq!(e.http_status().as_u16(), 400);
        assert!(
            e.message.contains("firecracker") && e.message.contains("microvm"),
            "{e}"
        );
        assert!(!with(Some("namespace"), "microvm").unwrap().microvm);
        assert!(with(Some("microvm"), "namespace").unwrap().microvm);
        assert!(with(None, "microvm").unwrap().microvm);
        assert!(!with(None, "namespace").unwrap().microvm);
        assert!(check_template("py3.12-slim").is_ok());
        for bad in ["", "Bad", "../x", ".x", &"a".repeat(64)] {
            assert_eq!(
                check_template(bad).unwrap_err().http_status().as_u16(),
                400,
                "{bad}"
            );
        }
    }

    #[tokio::test]
    async fn rows_roundtrip_and_replace() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_sqlite(&dir.path().join("space.db"))
            .await
            .unwrap();
        assert!(store.list_pools().await.unwrap().is_empty());
        assert!(store.get_pool("base").await.unwrap().is_none());
        let row = |t: &str, min, max, at| PoolRow {
            template: t.into(),
            min,
            max,
            runtime: "namespace".into(),
            updated_at: at,
        };
        store.put_pool(&row("py3", 1, 2, 10)).await.unwrap();
        store.put_pool(&row("base", 4, 32, 11)).await.unwrap();
        store
            .put_pool(&row("py3", 1_000_000, u32::MAX, 12))
            .await
            .unwrap();
        assert_eq!(
            store.list_pools().await.unwrap(),
            vec![row("base", 4, 32, 11), row("py3", 1_000_000, u32::MAX, 12)]
        );
        assert_eq!(
            store.get_pool("base").await.unwrap(),
            Some(row("base", 4, 32, 11))
        );
    }
}
