//! Tenants, scoped keys and who may touch what (decision 0040).
//!
//! [`authorize`] runs in the auth middleware for every request with a valid key, from the
//! route's matched path: a handler cannot forget it. Another tenant's sandbox answers what a
//! missing one does (404, same message and shape); an admin route answers 403 to other
//! scopes; a read-only key's write answers 403. Secrets are the key's own tenant's (the
//! handlers scope them); a template is read by its tenant or by all when shared, and written
//! by its tenant only (decision 0048).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::response::{IntoResponse, Response};
use space_api::tenant::{
    ApiKey, DEFAULT_TENANT, KeyScope, SetTenant, Tenant, TenantQuota, is_valid_tenant_id,
};
use sqlx::Row;

use crate::error::{ControlError, ControlResult, ErrorKind};
use crate::store::{Store, StoreError, now_ms};

/// Who a request is: its key's id, tenant and scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub key_id: String,
    pub tenant: String,
    pub scope: KeyScope,
    /// Requests a second it may make (None: no limit).
    pub rate_per_sec: Option<u32>,
}

impl Principal {
    pub fn is_admin(&self) -> bool {
        self.scope == KeyScope::Admin
    }

    /// The tenant whose objects a list shows: None for an admin (every tenant's).
    pub fn list_filter(&self) -> Option<&str> {
        (!self.is_admin()).then_some(self.tenant.as_str())
    }

    /// The principal of work the control plane does itself (builds, tests).
    pub fn system() -> Self {
        Self {
            key_id: "system".into(),
            tenant: DEFAULT_TENANT.into(),
            scope: KeyScope::Admin,
            rate_per_sec: None,
        }
    }
}

/// How a route is guarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Any valid key may read it (the E2B settings).
    Shared,
    /// The objects of the key's own tenant, which the handler scopes (secrets, the lists of
    /// templates and pools).
    Tenant,
    /// One template (`/v1/templates/{name}` and below, its pool aside): see
    /// [`template_access`].
    Template,
    /// A template's warm pool: its template's tenant's alone (see [`pool_access`]).
    TemplatePool,
    /// A collection of sandboxes: lists are filtered and creates stamped by the handler.
    Sandboxes,
    /// One sandbox and what is under it: its tenant's keys only.
    Sandbox,
    /// Admin keys only.
    Admin,
}

/// The guard of route `path` (the matched pattern) with `method`.
pub fn access(method: &str, path: &str) -> Access {
    const SANDBOX_PREFIXES: [&str; 3] = [
        "/v1/sandboxes/{id}",
        "/sandboxes/{id}",
        "/v2/sandboxes/{id}",
    ];
    match (method, path) {
        // Moving a sandbox between nodes is the operator's call.
        (_, "/v1/sandboxes/{id}/migrate") => Access::Admin,
        (_, "/v1/sandboxes" | "/sandboxes" | "/v2/sandboxes") => Access::Sandboxes,
        ("GET", "/v1/e2b") => Access::Shared,
        (_, "/v1/secrets" | "/v1/secrets/{name}" | "/secrets" | "/secrets/{id}")
        | ("GET", "/v1/templates" | "/v1/pools" | "/snapshots") => Access::Tenant,
        // E2B's removal of a snapshot, which is a template.
        (_, "/templates/{id}") => Access::Template,
        (_, "/v1/templates/{name}/pool") => Access::TemplatePool,
        (_, p) if p == "/v1/templates/{name}" || p.starts_with("/v1/templates/{name}/") => {
            Access::Template
        }
        _ if SANDBOX_PREFIXES.iter().any(|p| {
            path.strip_prefix(p)
                .is_some_and(|r| r.is_empty() || r.starts_with('/'))
        }) =>
        {
            Access::Sandbox
        }
        _ => Access::Admin,
    }
}

fn is_read(method: &axum::http::Method) -> bool {
    matches!(*method, axum::http::Method::GET | axum::http::Method::HEAD)
}

/// An answer in the shape of the route's API (E2B's for its paths).
pub(crate) fn refuse(path: &str, e: ControlError) -> Response {
    if crate::e2b::is_control_path(path) {
        crate::e2b::E2bError(e).into_response()
    } else {
        e.into_response()
    }
}

/// Whether `who` may make this request; the refusal to answer when not.
pub async fn authorize(
    engine: &crate::Engine,
    who: &Principal,
    method: &axum::http::Method,
    route: Option<&str>,
    path: &str,
) -> Result<(), Response> {
    if who.is_admin() {
        return Ok(());
    }
    // No route matched: the fallback answers 404 or 405 and touches nothing.
    let Some(route) = route else { return Ok(()) };
    if who.scope == KeyScope::ReadOnly && !is_read(method) {
        return Err(refuse(
            path,
            ControlError::new(
                ErrorKind::PermissionDenied,
                "a read-only key cannot change anything",
            ),
        ));
    }
    match access(method.as_str(), route) {
        Access::Shared | Access::Sandboxes | Access::Tenant => Ok(()),
        Access::Template | Access::TemplatePool => {
            let Some(name) = path
                .strip_prefix("/v1/templates/")
                .or_else(|| path.strip_prefix("/templates/"))
                .and_then(|r| r.split('/').next())
                .filter(|n| space_api::is_valid_template_name(n))
            else {
                return Ok(()); // no template has such a name: the handler answers
            };
            let checked = if access(method.as_str(), route) == Access::Template {
                template_access(engine, who, method, name).await
            } else {
                pool_access(engine, who, name).await
            };
            checked.map_err(|e| refuse(path, e))
        }
        Access::Admin => Err(refuse(
            path,
            ControlError::new(
                ErrorKind::PermissionDenied,
                format!("{method} {route} needs an admin key"),
            ),
        )),
        Access::Sandbox => {
            let Some(id) = crate::events::sandbox_of(path) else {
                return Ok(()); // a malformed id: the handler answers 400
            };
            match engine.owners.tenant_of(&engine.store, id).await {
                Ok(Some(t)) if t == who.tenant => Ok(()),
                Ok(_) => Err(if crate::e2b::is_control_path(path) {
                    crate::e2b::control::sandbox_not_found(id).into_response()
                } else {
                    ControlError::not_found(format!("sandbox {id} not found")).into_response()
                }),
                Err(e) => Err(refuse(path, e.into())),
            }
        }
    }
}

/// Whether `who` (not an admin) may make a `method` request on template `name`. What it
/// answers for a name it does not own depends on the name alone, never on whether another
/// tenant's private template of that name exists:
/// - its own tenant's template: anything;
/// - a read: allowed when the template is shared, else 404;
/// - a write to a shared template: 403 (read-only);
/// - a write to a name `TENANT.NAME` of its own tenant that nobody owns: claims the name;
/// - a write to `OTHER.NAME`, another tenant's name space: 404;
/// - a write to any other name: 403, since a tenant's templates are named `TENANT.NAME`, so
///   that one tenant's names never meet another's.
async fn template_access(
    engine: &crate::Engine,
    who: &Principal,
    method: &axum::http::Method,
    name: &str,
) -> ControlResult<()> {
    let not_found = || ControlError::not_found(format!("template {name} not found"));
    let s = engine.store.template_settings(name).await?;
    if s.owner() == who.tenant {
        return Ok(());
    }
    if is_read(method) {
        return if s.is_shared() {
            Ok(())
        } else {
            Err(not_found())
        };
    }
    if s.is_shared()
        && (s.tenant.is_some() || !engine.node.template_versions(name).await?.is_empty())
    {
        return Err(ControlError::new(
            ErrorKind::PermissionDenied,
            format!("template {name} is shared read-only: only its own tenant changes it"),
        ));
    }
    match name.split_once('.') {
        Some((t, rest)) if t == who.tenant && !rest.is_empty() => {
            // A private template of `default`'s by that name (an operator's) is not the
            // tenant's to take.
            if s.tenant.is_none() && !engine.node.template_versions(name).await?.is_empty() {
                return Err(not_found());
            }
            if engine.store.claim_template(name, &who.tenant).await? == who.tenant {
                Ok(())
            } else {
                Err(not_found())
            }
        }
        Some((t, _)) if is_valid_tenant_id(t) => Err(not_found()),
        _ => Err(ControlError::new(
            ErrorKind::PermissionDenied,
            format!(
                "tenant {t}'s templates are named {t}.NAME, and {name} is not",
                t = who.tenant
            ),
        )),
    }
}

/// Whether `who` (not an admin) may read or size the warm pool of template `name`: only its
/// template's own tenant may (a pool's members are charged to that tenant's quota, and its
/// hits and misses are that tenant's activity). Another tenant's shared template: 403;
/// a template it may not see: 404; a name nobody has: the handler answers (404).
async fn pool_access(engine: &crate::Engine, who: &Principal, name: &str) -> ControlResult<()> {
    let s = engine.store.template_settings(name).await?;
    if s.owner() == who.tenant
        || (s.tenant.is_none() && engine.node.template_versions(name).await?.is_empty())
    {
        return Ok(());
    }
    if s.is_shared() {
        return Err(ControlError::new(
            ErrorKind::PermissionDenied,
            format!(
                "the warm pool of template {name} is tenant {}'s: only it sizes or reads it",
                s.owner()
            ),
        ));
    }
    Err(ControlError::not_found(format!(
        "template {name} not found"
    )))
}

/// Sandbox id to tenant, as read from the store. A sandbox never changes tenant, so an
/// entry never goes stale; a deleted sandbox's entry only answers for an id nobody reuses.
#[derive(Debug, Default)]
pub struct Owners {
    map: Mutex<HashMap<String, String>>,
}

/// Entries kept before the map starts over (about 10 MB).
const OWNERS_MAX: usize = 100_000;

impl Owners {
    /// The tenant of sandbox `id`; None when there is no such sandbox.
    pub async fn tenant_of(&self, store: &Store, id: &str) -> Result<Option<String>, StoreError> {
        if let Some(t) = self.map.lock().unwrap_or_else(|e| e.into_inner()).get(id) {
            return Ok(Some(t.clone()));
        }
        let Some(t) = store.sandbox_tenant(id).await? else {
            return Ok(None);
        };
        self.note(id, &t);
        Ok(Some(t))
    }

    /// Records a sandbox's tenant (at create, so its first request needs no read).
    pub fn note(&self, id: &str, tenant: &str) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= OWNERS_MAX {
            map.clear();
        }
        map.insert(id.to_owned(), tenant.to_owned());
    }
}

/// A tenant id from a request, checked.
pub fn check_tenant_id(id: &str) -> ControlResult<()> {
    if is_valid_tenant_id(id) {
        Ok(())
    } else {
        Err(ControlError::invalid(format!(
            "invalid tenant id {id:?}: 1 to 63 of a-z, 0-9 and -, not starting with -"
        )))
    }
}

/// One row of `api_keys`, as the key cache and the key API see it.
#[derive(Debug, Clone)]
pub struct KeyRow {
    pub id: String,
    pub hash: String,
    pub name: String,
    pub tenant: String,
    pub scope: KeyScope,
    pub created_at: i64,
    pub expires_at: Option<i64>,
    pub revoked_at: Option<i64>,
    /// As asked at creation (None: the scope's default).
    pub rate_per_sec: Option<u32>,
}

impl KeyRow {
    /// The requests a second it may make: its own rate, else its scope's default.
    pub fn rate(&self) -> Option<u32> {
        match (self.rate_per_sec, self.scope) {
            (Some(r), _) => Some(r),
            (None, KeyScope::Admin) => None,
            (None, _) => Some(space_api::tenant::DEFAULT_KEY_RATE),
        }
    }

    /// Whether it works at `now` (not revoked, not expired).
    pub fn live(&self, now: i64) -> bool {
        self.revoked_at.is_none() && self.expires_at.is_none_or(|t| now < t)
    }

    pub fn dto(&self) -> ApiKey {
        ApiKey {
            id: self.id.clone(),
            tenant: self.tenant.clone(),
            scope: self.scope,
            name: self.name.clone(),
            rate_per_sec: self.rate(),
            created_at: space_api::rfc3339_from_unix_ms(self.created_at),
            expires_at: self.expires_at.map(space_api::rfc3339_from_unix_ms),
            revoked_at: self.revoked_at.map(space_api::rfc3339_from_unix_ms),
        }
    }
}

fn q(what: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| StoreError::Query { what, source }
}

const KEY_COLUMNS: &str =
    "id, hash, name, tenant_id, scope, created_at, expires_at, revoked_at, rate_per_sec";

fn decode_key(r: &sqlx::any::AnyRow) -> Result<KeyRow, StoreError> {
    let scope: String = r.try_get("scope").map_err(q("decode key"))?;
    Ok(KeyRow {
        id: r.try_get("id").map_err(q("decode key"))?,
        hash: r.try_get("hash").map_err(q("decode key"))?,
        name: r.try_get("name").map_err(q("decode key"))?,
        tenant: r.try_get("tenant_id").map_err(q("decode key"))?,
        scope: scope.parse().map_err(|reason| StoreError::Corrupt {
            id: "api_keys".into(),
            reason,
        })?,
        created_at: r.try_get("created_at").map_err(q("decode key"))?,
        expires_at: r.try_get("expires_at").map_err(q("decode key"))?,
        revoked_at: r.try_get("revoked_at").map_err(q("decode key"))?,
        rate_per_sec: r
            .try_get::<Option<i64>, _>("rate_per_sec")
            .map_err(q("decode key"))?
            .map(|n| n.clamp(1, i64::from(u32::MAX)) as u32),
    })
}

/// A tenant's settings as stored.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TenantSettings {
    pub replicas: Option<u32>,
    pub quota: TenantQuota,
}

/// A tenant's settings columns, in the order [`settings_columns`] binds them.
const SETTINGS_COLUMNS: &str =
    "replicas, max_sandboxes, max_cpu_millis, max_memory_mib, max_snapshots, max_disk_mib";

/// A tenant's settings as their columns, in the order of [`SETTINGS_COLUMNS`] (what
/// [`decode_settings`] reads).
fn settings_columns(s: &TenantSettings) -> [Option<i64>; 6] {
    let q = &s.quota;
    let mib = |m: u64| m.min(i64::MAX as u64) as i64;
    [
        s.replicas.map(i64::from),
        q.sandboxes.map(i64::from),
        q.cpu.map(|c| (c * 1000.0).round() as i64),
        q.memory_mib.map(mib),
        q.snapshots.map(i64::from),
        q.disk_mib.map(mib),
    ]
}

/// A tenant row's settings (its `replicas` and `max_*` columns).
fn decode_settings(r: &sqlx::any::AnyRow) -> Result<TenantSettings, StoreError> {
    let get = |c: &str| -> Result<Option<i64>, StoreError> {
        r.try_get::<Option<i64>, _>(c)
            .map_err(q("read tenant settings"))
    };
    let u32_of = |n: i64| n.clamp(0, i64::from(u32::MAX)) as u32;
    Ok(TenantSettings {
        replicas: get("replicas")?.map(u32_of),
        quota: TenantQuota {
            sandboxes: get("max_sandboxes")?.map(u32_of),
            cpu: get("max_cpu_millis")?.map(|m| m.max(0) as f64 / 1000.0),
            memory_mib: get("max_memory_mib")?.map(|m| m.max(0) as u64),
            snapshots: get("max_snapshots")?.map(u32_of),
            disk_mib: get("max_disk_mib")?.map(|m| m.max(0) as u64),
        },
    })
}

/// What sandboxes hold or ask for of a quota: how many, and the CPU, memory and disk (MiB)
/// their limits claim.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Claim {
    pub sandboxes: u64,
    pub cpu: f64,
    pub memory_mib: u64,
    /// Disk limits (a pool member has none until it is handed out with its create's).
    pub disk_mib: u64,
}

impl Claim {
    /// `n` sandboxes at the default limits: what a warm pool's members claim.
    pub fn pool_members(n: u64) -> Self {
        Self {
            sandboxes: n,
            cpu: n as f64 * space_api::DEFAULT_CPU,
            memory_mib: n * space_api::DEFAULT_MEMORY_MIB,
            disk_mib: 0,
        }
    }

    fn add(&mut self, o: Claim) {
        self.sandboxes += o.sandboxes;
        self.cpu += o.cpu;
        self.memory_mib += o.memory_mib;
        self.disk_mib += o.disk_mib;
    }
}

impl From<&crate::store::SandboxSpecRecord> for Claim {
    fn from(s: &crate::store::SandboxSpecRecord) -> Self {
        Self {
            sandboxes: 1,
            cpu: s.cpu,
            memory_mib: s.memory_mib,
            disk_mib: s.disk_mib.unwrap_or(0),
        }
    }
}

/// Why `quota` refuses `asked` more of `tenant`, which holds `held` now (its sandboxes not
/// deleted and its warm pools' members); None when it fits.
pub fn quota_refusal(
    tenant: &str,
    quota: &TenantQuota,
    held: Claim,
    asked: Claim,
) -> Option<String> {
    let n = held.sandboxes;
    if let Some(max) = quota.sandboxes
        && n + asked.sandboxes > u64::from(max)
    {
        return Some(format!(
            "tenant {tenant}'s quota of {max} sandboxes is used up ({n} held: not deleted, or \
             warm in its pools; {} asked): remove some, or ask for a larger quota",
            asked.sandboxes
        ));
    }
    if let Some(max) = quota.cpu
        && held.cpu + asked.cpu > max + 1e-9
    {
        return Some(format!(
            "tenant {tenant}'s CPU quota of {max} cores would be exceeded ({} claimed, {} \
             asked)",
            held.cpu, asked.cpu
        ));
    }
    if let Some(max) = quota.memory_mib
        && held.memory_mib + asked.memory_mib > max
    {
        return Some(format!(
            "tenant {tenant}'s memory quota of {max} MiB would be exceeded ({} MiB claimed, \
             {} MiB asked)",
            held.memory_mib, asked.memory_mib
        ));
    }
    if let Some(max) = quota.disk_mib
        && held.disk_mib + asked.disk_mib > max
    {
        return Some(format!(
            "tenant {tenant}'s disk quota of {max} MiB would be exceeded ({} MiB claimed by \
             its sandboxes' disk limits, {} MiB asked): ask for a smaller --disk, remove a \
             sandbox, or ask for a larger quota",
            held.disk_mib, asked.disk_mib
        ));
    }
    None
}

/// The warm pool members a tenant's templates may hold (their pools' `max`), but for
/// template `$2`'s.
const TENANT_POOL_MEMBERS: &str = "SELECT COALESCE(SUM(p.max), 0) FROM template_pools p \
     JOIN template_settings t ON t.template = p.template WHERE t.tenant_id = $1 \
     AND p.template <> $2";

/// Checks a quota a request sets.
fn check_quota(q: &TenantQuota) -> ControlResult<()> {
    if let Some(c) = q.cpu
        && !(c.is_finite() && c > 0.0 && c <= 1e6)
    {
        return Err(ControlError::invalid(format!(
            "quota cpu must be a positive number of cores, got {c}"
        )));
    }
    Ok(())
}

impl Store {
    /// Every key, revoked and expired ones included, oldest first.
    pub async fn api_keys(&self) -> Result<Vec<KeyRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {KEY_COLUMNS} FROM api_keys ORDER BY created_at, id"
        ))
        .fetch_all(self.pool())
        .await
        .map_err(q("list api keys"))?;
        rows.iter().map(decode_key).collect()
    }

    pub async fn api_key(&self, id: &str) -> Result<Option<KeyRow>, StoreError> {
        let row = sqlx::query(&format!("SELECT {KEY_COLUMNS} FROM api_keys WHERE id = $1"))
            .bind(id)
            .fetch_optional(self.pool())
            .await
            .map_err(q("read api key"))?;
        row.as_ref().map(decode_key).transpose()
    }

    pub async fn insert_key(&self, k: &KeyRow) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO api_keys (id, hash, name, tenant_id, scope, created_at, expires_at, \
             revoked_at, rate_per_sec) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(&k.id)
        .bind(&k.hash)
        .bind(&k.name)
        .bind(&k.tenant)
        .bind(k.scope.as_str())
        .bind(k.created_at)
        .bind(k.expires_at)
        .bind(k.revoked_at)
        .bind(k.rate_per_sec.map(i64::from))
        .execute(self.pool())
        .await
        .map_err(q("insert api key"))?;
        Ok(())
    }

    /// Sets when key `id` stops working (never later than it already would).
    pub async fn expire_key(&self, id: &str, at: i64) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE api_keys SET expires_at = CASE WHEN expires_at IS NULL OR expires_at > $2 \
             THEN $2 ELSE expires_at END WHERE id = $1",
        )
        .bind(id)
        .bind(at)
        .execute(self.pool())
        .await
        .map_err(q("expire api key"))?;
        Ok(())
    }

    /// Revokes key `id`; false when it was revoked already or does not exist.
    pub async fn revoke_key(&self, id: &str) -> Result<bool, StoreError> {
        let done =
            sqlx::query("UPDATE api_keys SET revoked_at = $2 WHERE id = $1 AND revoked_at IS NULL")
                .bind(id)
                .bind(now_ms())
                .execute(self.pool())
                .await
                .map_err(q("revoke api key"))?;
        Ok(done.rows_affected() == 1)
    }

    /// The tenant of sandbox `id` (deleted ones too, until their row goes).
    pub async fn sandbox_tenant(&self, id: &str) -> Result<Option<String>, StoreError> {
        let row = sqlx::query("SELECT tenant_id FROM sandboxes WHERE id = $1")
            .bind(id)
            .fetch_optional(self.pool())
            .await
            .map_err(q("read sandbox tenant"))?;
        row.map(|r| r.try_get(0).map_err(q("read sandbox tenant")))
            .transpose()
    }

    /// Inserts tenant `id`; false when it exists.
    pub async fn insert_tenant(
        &self,
        id: &str,
        settings: &TenantSettings,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "INSERT INTO tenants (id, created_at, {SETTINGS_COLUMNS}) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (id) DO NOTHING"
        );
        let mut query = sqlx::query(&sql).bind(id).bind(now_ms());
        for c in settings_columns(settings) {
            query = query.bind(c);
        }
        let done = query
            .execute(self.pool())
            .await
            .map_err(q("insert tenant"))?;
        Ok(done.rows_affected() == 1)
    }

    /// Every tenant with its live sandboxes and its live keys, by id.
    pub async fn tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        let now = now_ms();
        let rows = sqlx::query(
            "SELECT t.id, t.created_at, t.replicas, t.max_sandboxes, t.max_cpu_millis, \
               t.max_memory_mib, t.max_snapshots, t.max_disk_mib, \
               (SELECT COUNT(*) FROM sandboxes s WHERE s.tenant_id = t.id \
                  AND s.deleted_at IS NULL) AS sandboxes, \
               (SELECT COUNT(*) FROM api_keys k WHERE k.tenant_id = t.id \
                  AND k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > $1)) \
                  AS keys \
             FROM tenants t ORDER BY t.id",
        )
        .bind(now)
        .fetch_all(self.pool())
        .await
        .map_err(q("list tenants"))?;
        rows.iter()
            .map(|r| {
                let n = |c: &str| -> Result<u64, StoreError> {
                    Ok(r.try_get::<i64, _>(c).map_err(q("list tenants"))?.max(0) as u64)
                };
                let settings = decode_settings(r)?;
                Ok(Tenant {
                    id: r.try_get("id").map_err(q("list tenants"))?,
                    created_at: space_api::rfc3339_from_unix_ms(
                        r.try_get("created_at").map_err(q("list tenants"))?,
                    ),
                    sandboxes: n("sandboxes")?,
                    keys: n("keys")?,
                    replicas: settings.replicas,
                    quota: Some(settings.quota).filter(|q| !q.is_empty()),
                })
            })
            .collect()
    }

    /// Sets tenant `id`'s settings, replaced whole; false when there is no such tenant.
    pub async fn set_tenant_settings(
        &self,
        id: &str,
        settings: &TenantSettings,
    ) -> Result<bool, StoreError> {
        let mut query = sqlx::query(
            "UPDATE tenants SET replicas = $2, max_sandboxes = $3, max_cpu_millis = $4, \
             max_memory_mib = $5, max_snapshots = $6, max_disk_mib = $7 WHERE id = $1",
        )
        .bind(id);
        for c in settings_columns(settings) {
            query = query.bind(c);
        }
        let done = query.execute(self.pool()).await.map_err(q("set tenant"))?;
        Ok(done.rows_affected() == 1)
    }

    /// Tenant `id`'s settings (the defaults when there is no such tenant).
    pub async fn tenant_settings(&self, id: &str) -> Result<TenantSettings, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {SETTINGS_COLUMNS} FROM tenants WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(self.pool())
        .await
        .map_err(q("read tenant"))?;
        row.as_ref()
            .map_or_else(|| Ok(TenantSettings::default()), decode_settings)
    }

    /// Inserts a sandbox's row when its tenant's quota still has room for it, in one
    /// transaction that first locks the tenant's row (concurrent creates of one tenant wait
    /// for each other here): the quota it would break, when it does.
    pub async fn insert_sandbox_in_quota(
        &self,
        row: &crate::store::SandboxRow,
        quota: &TenantQuota,
    ) -> Result<Option<String>, StoreError> {
        let mut tx = self.pool().begin().await.map_err(q("insert sandbox"))?;
        sqlx::query("UPDATE tenants SET id = id WHERE id = $1")
            .bind(&row.tenant)
            .execute(&mut *tx)
            .await
            .map_err(q("lock tenant"))?;
        let held = tenant_claims(&mut tx, &row.tenant, "").await?;
        if let Some(why) = quota_refusal(&row.tenant, quota, held, Claim::from(&row.spec)) {
            return Ok(Some(why));
        }
        crate::store::insert_sandbox_with(&mut *tx, row).await?;
        tx.commit().await.map_err(q("insert sandbox"))?;
        Ok(None)
    }

    /// What tenant `tenant` holds of its quota, but for the pool of `template` (so that a
    /// pool's new size is checked against the rest).
    pub async fn tenant_claims(&self, tenant: &str, template: &str) -> Result<Claim, StoreError> {
        let mut conn = self
            .pool()
            .acquire()
            .await
            .map_err(q("sum tenant claims"))?;
        tenant_claims(&mut conn, tenant, template).await
    }

    /// Snapshots of tenant `tenant`'s sandboxes.
    pub async fn tenant_snapshots(&self, tenant: &str) -> Result<u64, StoreError> {
        let row = sqlx::query(
            "SELECT COUNT(*) FROM snapshots sn JOIN sandboxes s ON s.id = sn.sandbox_id \
             WHERE s.tenant_id = $1",
        )
        .bind(tenant)
        .fetch_one(self.pool())
        .await
        .map_err(q("count tenant snapshots"))?;
        Ok(row
            .try_get::<i64, _>(0)
            .map_err(q("count tenant snapshots"))?
            .max(0) as u64)
    }

    pub async fn delete_tenant_row(&self, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query("DELETE FROM tenants WHERE id = $1")
            .bind(id)
            .execute(self.pool())
            .await
            .map_err(q("delete tenant"))?;
        Ok(done.rows_affected() == 1)
    }
}

/// What `tenant` holds (see [`Store::tenant_claims`]), read on `conn` (a transaction's, in a
/// create).
async fn tenant_claims(
    conn: &mut sqlx::AnyConnection,
    tenant: &str,
    template: &str,
) -> Result<Claim, StoreError> {
    let specs =
        sqlx::query("SELECT spec FROM sandboxes WHERE tenant_id = $1 AND deleted_at IS NULL")
            .bind(tenant)
            .fetch_all(&mut *conn)
            .await
            .map_err(q("sum tenant claims"))?;
    let mut held = Claim::default();
    for r in &specs {
        let spec: String = r.try_get(0).map_err(q("sum tenant claims"))?;
        if let Ok(s) = serde_json::from_str::<crate::store::SandboxSpecRecord>(&spec) {
            held.add(Claim::from(&s));
        }
    }
    let pooled: i64 = sqlx::query(TENANT_POOL_MEMBERS)
        .bind(tenant)
        .bind(template)
        .fetch_one(&mut *conn)
        .await
        .and_then(|r| r.try_get(0))
        .map_err(q("sum tenant pools"))?;
    held.add(Claim::pool_members(pooled.max(0) as u64));
    Ok(held)
}

/// How long a replica uses a tenant's settings before it reads them again (a change made
/// through another replica reaches its creates within this).
const SETTINGS_FRESH: Duration = Duration::from_secs(1);

/// Tenants' settings as last read, per tenant.
#[derive(Debug, Default)]
pub struct TenantDefaults {
    map: Mutex<HashMap<String, (Instant, TenantSettings)>>,
}

impl crate::Engine {
    pub async fn create_tenant(
        &self,
        req: space_api::tenant::CreateTenant,
    ) -> ControlResult<Tenant> {
        check_tenant_id(&req.id)?;
        let settings = self.checked_settings(req.replicas, req.quota)?;
        if !self.store.insert_tenant(&req.id, &settings).await? {
            return Err(ControlError::conflict(format!("tenant {} exists", req.id)));
        }
        self.tenant(&req.id).await
    }

    fn checked_settings(
        &self,
        replicas: Option<u32>,
        quota: Option<TenantQuota>,
    ) -> ControlResult<TenantSettings> {
        if let Some(n) = replicas {
            self.check_replicas(n)?;
        }
        let quota = quota.unwrap_or_default();
        check_quota(&quota)?;
        Ok(TenantSettings { replicas, quota })
    }

    /// `PUT /v1/tenants/{id}`: its settings, replaced whole; new creates use them (a quota
    /// lowered below what the tenant holds refuses new sandboxes, and removes none).
    pub async fn set_tenant(&self, id: &str, req: SetTenant) -> ControlResult<Tenant> {
        check_tenant_id(id)?;
        let settings = self.checked_settings(req.replicas, req.quota)?;
        if !self.store.set_tenant_settings(id, &settings).await? {
            return Err(ControlError::not_found(format!("tenant {id} not found")));
        }
        self.tenant_defaults
            .map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        self.tenant(id).await
    }

    /// Tenant `tenant`'s settings, read at most once a second.
    async fn tenant_settings(&self, tenant: &str) -> ControlResult<TenantSettings> {
        if let Some((at, s)) = self
            .tenant_defaults
            .map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(tenant)
            && at.elapsed() < SETTINGS_FRESH
        {
            return Ok(s.clone());
        }
        let s = self.store.tenant_settings(tenant).await?;
        self.tenant_defaults
            .map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(tenant.to_owned(), (Instant::now(), s.clone()));
        Ok(s)
    }

    /// The disk limit a namespace create of `tenant` that names none gets: under a disk
    /// quota, [`space_api::tenant::DEFAULT_QUOTA_DISK_MIB`] or the quota when smaller (at
    /// least the smallest limit a create may name), else the configured default (spaced's
    /// `--default-disk`), else none.
    pub(crate) async fn default_disk_for(&self, tenant: &str) -> ControlResult<Option<u64>> {
        Ok(self
            .tenant_settings(tenant)
            .await?
            .quota
            .disk_mib
            .map(|q| space_api::tenant::DEFAULT_QUOTA_DISK_MIB.min(q).max(16))
            .or(self.cfg.default_disk_mib))
    }

    /// The replicas a create of `tenant` gets when neither it nor its template says.
    pub(crate) async fn tenant_default_replicas(&self, tenant: &str) -> ControlResult<u32> {
        Ok(self.tenant_settings(tenant).await?.replicas.unwrap_or(0))
    }

    /// Inserts a new sandbox's row, within its tenant's quota when it has one.
    pub(crate) async fn insert_sandbox_row(
        &self,
        row: &crate::store::SandboxRow,
    ) -> ControlResult<()> {
        let quota = self.tenant_settings(&row.tenant).await?.quota;
        if !quota.limits_sandboxes() {
            self.store.insert_sandbox(row).await?;
            return Ok(());
        }
        match self.store.insert_sandbox_in_quota(row, &quota).await? {
            None => Ok(()),
            Some(why) => Err(ControlError::new(ErrorKind::QuotaExceeded, why)),
        }
    }

    /// Refuses a warm pool of up to `max` members of template `template` that `tenant`'s
    /// quota has no room for, besides what the tenant holds otherwise.
    pub(crate) async fn check_pool_quota(
        &self,
        tenant: &str,
        template: &str,
        max: u32,
    ) -> ControlResult<()> {
        let quota = self.tenant_settings(tenant).await?.quota;
        if !quota.limits_sandboxes() {
            return Ok(());
        }
        let held = self.store.tenant_claims(tenant, template).await?;
        match quota_refusal(tenant, &quota, held, Claim::pool_members(u64::from(max))) {
            None => Ok(()),
            Some(why) => Err(ControlError::new(ErrorKind::QuotaExceeded, why)),
        }
    }

    /// Refuses a snapshot of a sandbox of `tenant` that its snapshot quota has no room for.
    pub(crate) async fn check_snapshot_quota(&self, tenant: &str) -> ControlResult<()> {
        let Some(max) = self.tenant_settings(tenant).await?.quota.snapshots else {
            return Ok(());
        };
        let n = self.store.tenant_snapshots(tenant).await?;
        if n + 1 > u64::from(max) {
            return Err(ControlError::new(
                ErrorKind::QuotaExceeded,
                format!(
                    "tenant {tenant}'s quota of {max} snapshots is used up ({n} kept): delete \
                     one, or ask for a larger quota"
                ),
            ));
        }
        Ok(())
    }

    pub async fn tenant(&self, id: &str) -> ControlResult<Tenant> {
        check_tenant_id(id)?;
        self.store
            .tenants()
            .await?
            .into_iter()
            .find(|t| t.id == id)
            .ok_or_else(|| ControlError::not_found(format!("tenant {id} not found")))
    }

    pub async fn list_tenants(&self) -> ControlResult<Vec<Tenant>> {
        Ok(self.store.tenants().await?)
    }

    /// Removes a tenant that holds nothing: no sandbox, no live key.
    pub async fn delete_tenant(&self, id: &str) -> ControlResult<()> {
        let t = self.tenant(id).await?;
        if id == DEFAULT_TENANT {
            return Err(ControlError::conflict("tenant default cannot be removed"));
        }
        if t.sandboxes > 0 || t.keys > 0 {
            return Err(ControlError::conflict(format!(
                "tenant {id} still has {} sandboxes and {} live keys: remove the sandboxes \
                 and revoke the keys first",
                t.sandboxes, t.keys
            )));
        }
        self.store.delete_tenant_row(id).await?;
        Ok(())
    }
}

/// Per-key token buckets (decision 0040): a key with a rate of R requests a second holds up
/// to 2R tokens, gets R a second, and spends one per request. Kept per control replica, in
/// memory: behind several replicas a key's rate is per replica.
#[derive(Debug, Default)]
pub struct RateLimiter {
    buckets: Mutex<HashMap<String, (f64, Instant)>>,
}

/// Buckets kept before full ones are dropped (a full bucket is the same as none).
const BUCKETS_MAX: usize = 100_000;

impl RateLimiter {
    /// Spends a token of `who`'s bucket: Err(time until one is there) when it is empty.
    pub fn take(&self, who: &Principal) -> Result<(), Duration> {
        self.take_at(who, Instant::now())
    }

    fn take_at(&self, who: &Principal, now: Instant) -> Result<(), Duration> {
        let Some(rate) = who.rate_per_sec.map(f64::from) else {
            return Ok(());
        };
        let burst = rate * 2.0;
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if buckets.len() >= BUCKETS_MAX {
            buckets.retain(|_, (tokens, at)| {
                *tokens + now.saturating_duration_since(*at).as_secs_f64() * rate < burst
            });
        }
        let (tokens, at) = buckets.entry(who.key_id.clone()).or_insert((burst, now));
        *tokens = (*tokens + now.saturating_duration_since(*at).as_secs_f64() * rate).min(burst);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - *tokens) / rate))
        }
    }
}

/// The 429 of an empty bucket, with Retry-After in whole seconds (at least 1).
pub fn too_many_requests(path: &str, wait: Duration) -> Response {
    let e = ControlError::new(
        ErrorKind::RateLimited,
        format!(
            "this key's request rate is used up; retry in {} ms",
            wait.as_millis().max(1)
        ),
    );
    let mut resp = refuse(path, e);
    let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
    if let Ok(v) = axum::http::HeaderValue::from_str(&secs.to_string()) {
        resp.headers_mut()
            .insert(axum::http::header::RETRY_AFTER, v);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(rate: Option<u32>) -> Principal {
        Principal {
            key_id: "k".into(),
            tenant: "t".into(),
            scope: KeyScope::Tenant,
            rate_per_sec: rate,
        }
    }

    #[test]
    fn a_bucket_gives_a_burst_then_its_rate() {
        let l = RateLimiter::default();
        let t0 = Instant::now();
        let who = key(Some(10));
        for i in 0..20 {
            assert!(l.take_at(&who, t0).is_ok(), "request {i} of the burst");
        }
        let wait = l.take_at(&who, t0).unwrap_err();
        assert!((90..=101).contains(&wait.as_millis()), "{wait:?}");
        // A tenth of a second later, one more.
        let t1 = t0 + Duration::from_millis(100);
        assert!(l.take_at(&who, t1).is_ok());
        assert!(l.take_at(&who, t1).is_err());
        // Idle for long, it is full again, never fuller.
        let t2 = t1 + Duration::from_secs(60);
        for _ in 0..20 {
            assert!(l.take_at(&who, t2).is_ok());
        }
        assert!(l.take_at(&who, t2).is_err());
        // Another key has its own bucket; a key without a rate has none.
        let other = Principal {
            key_id: "other".into(),
            ..key(Some(1))
        };
        assert!(l.take_at(&other, t2).is_ok());
        for _ in 0..1000 {
            assert!(l.take_at(&key(None), t2).is_ok());
        }
    }
}
