//! Client calls for tenants and API keys (a child of `client`, sharing its helpers).

use reqwest::Method;

use super::{Client, Result};
use crate::tenant::{
    ApiKey, ApiKeyList, CreateKey, CreateTenant, CreatedKey, RotateKey, SetTenant, Tenant,
    TenantList,
};

impl Client {
    /// `POST /v1/tenants`.
    pub async fn create_tenant(&self, req: &CreateTenant) -> Result<Tenant> {
        self.json(Self::with_json(
            self.request(Method::POST, "/v1/tenants"),
            req,
        ))
        .await
    }

    /// `GET /v1/tenants`.
    pub async fn list_tenants(&self) -> Result<Vec<Tenant>> {
        let list: TenantList = self.json(self.request(Method::GET, "/v1/tenants")).await?;
        Ok(list.tenants)
    }

    /// `PUT /v1/tenants/{id}`: its settings, replaced whole.
    pub async fn set_tenant(&self, id: &str, req: &SetTenant) -> Result<Tenant> {
        self.json(Self::with_json(
            self.request(Method::PUT, &format!("/v1/tenants/{id}")),
            req,
        ))
        .await
    }

    /// `DELETE /v1/tenants/{id}`: refused while it has sandboxes or live keys.
    pub async fn delete_tenant(&self, id: &str) -> Result<()> {
        self.empty(self.request(Method::DELETE, &format!("/v1/tenants/{id}")))
            .await
    }

    /// `POST /v1/keys`: the new key's value is in the answer, and nowhere else.
    pub async fn create_key(&self, req: &CreateKey) -> Result<CreatedKey> {
        self.json(Self::with_json(self.request(Method::POST, "/v1/keys"), req))
            .await
    }

    /// `GET /v1/keys[?tenant=]`.
    pub async fn list_keys(&self, tenant: Option<&str>) -> Result<Vec<ApiKey>> {
        let mut rb = self.request(Method::GET, "/v1/keys");
        if let Some(t) = tenant {
            rb = rb.query(&[("tenant", t)]);
        }
        let list: ApiKeyList = self.json(rb).await?;
        Ok(list.keys)
    }

    /// `POST /v1/keys/{id}/rotate`: a new key; the old one works for the overlap.
    pub async fn rotate_key(&self, id: &str, req: &RotateKey) -> Result<CreatedKey> {
        self.json(Self::with_json(
            self.request(Method::POST, &format!("/v1/keys/{id}/rotate")),
            req,
        ))
        .await
    }

    /// `DELETE /v1/keys/{id}`: the key fails from the next request on.
    pub async fn revoke_key(&self, id: &str) -> Result<()> {
        self.empty(self.request(Method::DELETE, &format!("/v1/keys/{id}")))
            .await
    }
}
