//! E2B's secrets (decision 0027): the `/secrets` API over space's secret vault, and the
//! network rules that put a secret into a header, as space's `secret_headers`.
//!
//! - An E2B secret is a space secret with no hosts or header of its own: a name, a sealed
//!   value, a version and metadata. Its id is its name (the SDKs take either).
//! - A rule `{"api.x.com": [{"transform": {"headers": {"Authorization": "Bearer
//!   ${e2b.secrets.KEY}"}}}]}` becomes a header the node's egress proxy sets on the
//!   sandbox's HTTPS requests to api.x.com, with KEY's value in it. The sandbox holds nothing:
//!   no value and no placeholder.

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::{Extension, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use space_api::{SecretHeader, SecretInfo};

use super::E2bError;
use super::control::{E2bResult, MAX_PAGE, invalid, page_reply};
use crate::AppState;
use crate::error::{ControlError, ErrorKind};
use crate::http::{ApiJson, ApiPath, ApiQuery};
use crate::tenants::Principal;

/// How a header value names a secret: `${e2b.secrets.NAME}`.
const SECRET_REF: &str = "${e2b.secrets.";
/// How it names a workload identity token, which space does not mint.
const IDENTITY_REF: &str = "${e2b.identity.";

/// One rule of `network.rules[host]`. Unknown fields are ignored, as E2B's API does.
#[derive(Debug, Deserialize)]
struct Rule {
    transform: Option<Transform>,
}

#[derive(Debug, Deserialize)]
struct Transform {
    headers: Option<BTreeMap<String, String>>,
}

/// `network.rules` as the headers the proxy sets: one per host and header. A header value
/// must name exactly one secret (`${e2b.secrets.NAME}`); the rest of it is kept around the
/// value. Whether the secrets exist and may go to those hosts is the vault's check.
pub(super) fn rule_headers(rules: &serde_json::Value) -> E2bResult<Vec<SecretHeader>> {
    let rules: BTreeMap<String, Vec<Rule>> = serde_json::from_value(rules.clone())
        .map_err(|e| invalid(format!("network.rules: {e}")))?;
    let mut out = Vec::new();
    for (host, list) in rules {
        if host.parse::<std::net::IpAddr>().is_ok() || host.contains('/') {
            return Err(invalid(format!(
                "network.rules[{host:?}]: space sets headers on HTTPS requests by host name; an \
                 IP address or CIDR cannot carry a rule"
            )));
        }
        let headers = list
            .into_iter()
            .filter_map(|r| r.transform.and_then(|t| t.headers))
            .flatten();
        for (name, value) in headers {
            let (secret, header) = header_template(&host, &name, &value)?;
            out.push(SecretHeader {
                secret,
                hosts: vec![host.clone()],
                header,
            });
        }
    }
    Ok(out)
}

/// `(secret, "Name: template")` of one rule header, `{}` standing where the value goes.
fn header_template(host: &str, name: &str, value: &str) -> E2bResult<(String, String)> {
    let at = |why: &str| invalid(format!("network.rules[{host:?}] header {name:?}: {why}"));
    if value.contains(IDENTITY_REF) {
        return Err(at(
            "workload identity tokens (iam) are not supported by space",
        ));
    }
    let Some((before, rest)) = value.split_once(SECRET_REF) else {
        return Err(at(
            "space only sets headers that carry a secret (${e2b.secrets.NAME})",
        ));
    };
    let Some((secret, after)) = rest.split_once('}') else {
        return Err(at("${e2b.secrets. is not closed by }"));
    };
    if after.contains(SECRET_REF) {
        return Err(at("a header can carry one secret only"));
    }
    if before.contains("{}") || after.contains("{}") {
        return Err(at("the text around the secret cannot contain {}"));
    }
    Ok((secret.to_owned(), format!("{name}: {before}{{}}{after}")))
}

/// E2B's `Secret`: never the value.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct E2bSecret {
    #[serde(rename = "secretID")]
    secret_id: String,
    name: String,
    current_version: u64,
    metadata: BTreeMap<String, String>,
    created_at: String,
    updated_at: String,
}

impl From<SecretInfo> for E2bSecret {
    fn from(s: SecretInfo) -> Self {
        Self {
            secret_id: s.name.clone(),
            name: s.name,
            current_version: s.version,
            metadata: s.metadata,
            created_at: s.created_at,
            updated_at: s.updated_at,
        }
    }
}

/// `NewSecret` (POST /secrets).
#[derive(Deserialize)]
pub(crate) struct NewSecret {
    name: String,
    value: String,
    metadata: Option<BTreeMap<String, String>>,
}

/// `SecretUpdate` (POST /secrets/{id}).
#[derive(Deserialize)]
pub(crate) struct SecretUpdate {
    value: String,
    metadata: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Deserialize)]
pub(super) struct SecretPath {
    id: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SecretQuery {
    limit: Option<usize>,
    next_token: Option<String>,
}

/// A missing secret in E2B's words.
fn secret_not_found(id: &str) -> E2bError {
    E2bError(ControlError::not_found(format!(
        "secret \"{id}\" not found"
    )))
}

/// The vault's 404 (and a malformed name, which no secret has) in E2B's words.
fn or_not_found(id: &str, e: ControlError) -> E2bError {
    if e.kind == ErrorKind::NotFound || !space_api::is_valid_secret_name(id) {
        secret_not_found(id)
    } else {
        E2bError(e)
    }
}

/// `POST /secrets`: 201 with the new secret (version 1), 409 when the name is taken.
pub(super) async fn create(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiJson(req): ApiJson<NewSecret>,
) -> E2bResult<Response> {
    let info = s
        .engine
        .vault
        .create_unbound(
            &who.tenant,
            &req.name,
            &req.value,
            req.metadata.unwrap_or_default(),
        )
        .await?;
    Ok((StatusCode::CREATED, Json(E2bSecret::from(info))).into_response())
}

/// `GET /secrets`: by name, in pages (`limit`, `nextToken`, `x-next-token`).
pub(super) async fn list(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiQuery(q): ApiQuery<SecretQuery>,
) -> E2bResult<Response> {
    let limit = q.limit.unwrap_or(MAX_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(invalid(format!(
            "limit must be between 1 and {MAX_PAGE}, got {limit}"
        )));
    }
    let all = s.engine.vault.list(&who.tenant).await?;
    let start = match &q.next_token {
        None => 0,
        Some(after) => all
            .iter()
            .position(|x| &x.name > after)
            .unwrap_or(all.len()),
    };
    let page: Vec<SecretInfo> = all[start..].iter().take(limit).cloned().collect();
    let next = (start + page.len() < all.len())
        .then(|| page.last().map(|x| x.name.clone()))
        .flatten();
    let body: Vec<E2bSecret> = page.into_iter().map(E2bSecret::from).collect();
    Ok(page_reply(body, next))
}

/// `GET /secrets/{id}`.
pub(super) async fn get(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiPath(p): ApiPath<SecretPath>,
) -> E2bResult<Json<E2bSecret>> {
    let info = s
        .engine
        .vault
        .get(&who.tenant, &p.id)
        .await
        .map_err(|e| or_not_found(&p.id, e))?;
    Ok(Json(info.into()))
}

/// `POST /secrets/{id}`: a new value as the next version (metadata replaced when given).
pub(super) async fn update(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiPath(p): ApiPath<SecretPath>,
    ApiJson(req): ApiJson<SecretUpdate>,
) -> E2bResult<Json<E2bSecret>> {
    if !space_api::is_valid_secret_name(&p.id) {
        return Err(secret_not_found(&p.id));
    }
    let info = s
        .engine
        .vault
        .update_value(&who.tenant, &p.id, &req.value, req.metadata)
        .await
        .map_err(|e| or_not_found(&p.id, e))?;
    Ok(Json(info.into()))
}

/// `DELETE /secrets/{id}`: 204. Sandboxes that use it keep running; the proxy then leaves
/// their requests as they are.
pub(super) async fn delete(
    State(s): State<AppState>,
    Extension(who): Extension<Principal>,
    ApiPath(p): ApiPath<SecretPath>,
) -> E2bResult<StatusCode> {
    s.engine
        .vault
        .delete(&who.tenant, &p.id)
        .await
        .map_err(|e| or_not_found(&p.id, e))?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn headers(v: serde_json::Value) -> Result<Vec<(String, Vec<String>, String)>, String> {
        rule_headers(&v)
            .map(|hs| {
                hs.into_iter()
                    .map(|h| (h.secret, h.hosts, h.header))
                    .collect()
            })
            .map_err(|e| e.0.message)
    }

    #[test]
    fn rules_become_headers_the_proxy_sets() {
        let got = headers(json!({
            "api.openai.test": [
                {"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.openai-key}"}}},
                {},
                {"transform": {}}
            ],
            "*.example.test": [{"transform": {"headers": {"X-Key": "${e2b.secrets.K} v1"}}}]
        }))
        .unwrap();
        assert_eq!(
            got,
            [
                (
                    "K".to_owned(),
                    vec!["*.example.test".to_owned()],
                    "X-Key: {} v1".to_owned()
                ),
                (
                    "openai-key".to_owned(),
                    vec!["api.openai.test".to_owned()],
                    "Authorization: Bearer {}".to_owned()
                ),
            ]
        );
        assert_eq!(headers(json!({})).unwrap(), []);
    }

    #[test]
    fn rules_space_cannot_keep_are_refused_by_name() {
        for (rules, why) in [
            (
                json!({"1.2.3.4": [{"transform": {"headers": {"A": "${e2b.secrets.K}"}}}]}),
                "IP address or CIDR",
            ),
            (
                json!({"10.0.0.0/8": [{"transform": {"headers": {"A": "${e2b.secrets.K}"}}}]}),
                "IP address or CIDR",
            ),
            (
                json!({"a.test": [{"transform": {"headers": {"A": "plain"}}}]}),
                "only sets headers that carry a secret",
            ),
            (
                json!({"a.test": [{"transform": {"headers": {"A": "${e2b.secrets.K"}}}]}),
                "not closed",
            ),
            (
                json!({"a.test": [{"transform": {"headers": {"A": "${e2b.secrets.K}${e2b.secrets.L}"}}}]}),
                "one secret only",
            ),
            (
                json!({"a.test": [{"transform": {"headers": {"A": "{} ${e2b.secrets.K}"}}}]}),
                "cannot contain {}",
            ),
            (
                json!({"a.test": [{"transform": {"headers": {"A": "${e2b.identity.tokens.aws}"}}}]}),
                "iam",
            ),
            (json!({"a.test": "nope"}), "network.rules"),
        ] {
            let e = headers(rules.clone()).unwrap_err();
            assert!(e.contains(why), "{rules}: {e}");
        }
    }
}
