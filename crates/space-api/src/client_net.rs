//! Client calls for networking, secrets and ports (a child of `client`, sharing its helpers).

use reqwest::Method;

use super::{Client, Result};
use crate::net::{NetworkPolicy, PortInfo, PortRequest, PutSecret, SecretInfo, SecretList};
use crate::types::Sandbox;

impl Client {
    /// `PUT /v1/sandboxes/{id}/network`: replaces the sandbox's egress policy (applied now
    /// when it runs, at its next start otherwise).
    pub async fn set_network(&self, id: &str, policy: &NetworkPolicy) -> Result<Sandbox> {
        self.json(Self::with_json(
            self.request(Method::PUT, &format!("/v1/sandboxes/{id}/network")),
            policy,
        ))
        .await
    }

    /// `POST /v1/sandboxes/{id}/ports`: the URL that reaches `port` inside the sandbox.
    pub async fn open_port(&self, id: &str, port: u16) -> Result<PortInfo> {
        self.json(Self::with_json(
            self.request(Method::POST, &format!("/v1/sandboxes/{id}/ports")),
            &PortRequest { port: port.into() },
        ))
        .await
    }

    /// `PUT /v1/secrets/{name}`: creates or replaces a secret.
    pub async fn put_secret(&self, name: &str, req: &PutSecret) -> Result<SecretInfo> {
        self.json(Self::with_json(
            self.request(Method::PUT, &format!("/v1/secrets/{name}")),
            req,
        ))
        .await
    }

    /// `GET /v1/secrets`, by name.
    pub async fn list_secrets(&self) -> Result<Vec<SecretInfo>> {
        let list: SecretList = self.json(self.request(Method::GET, "/v1/secrets")).await?;
        Ok(list.secrets)
    }

    /// `GET /v1/secrets/{name}` (never the value).
    pub async fn get_secret(&self, name: &str) -> Result<SecretInfo> {
        self.json(self.request(Method::GET, &format!("/v1/secrets/{name}")))
            .await
    }

    /// `DELETE /v1/secrets/{name}`.
    pub async fn delete_secret(&self, name: &str) -> Result<()> {
        self.empty(self.request(Method::DELETE, &format!("/v1/secrets/{name}")))
            .await
    }
}
