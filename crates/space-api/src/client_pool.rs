//! Client calls for warm pools, nodes and the cluster (a child of `client`, sharing its
//! helpers).

use reqwest::Method;

use super::{Client, Result};
use crate::pool::{Pool, PoolList, SetPool};

impl Client {
    /// `GET /v1/nodes`: every node, with its capacity and what its sandboxes claim.
    pub async fn list_nodes(&self) -> Result<Vec<crate::node::Node>> {
        let list: crate::node::NodeList = self.json(self.request(Method::GET, "/v1/nodes")).await?;
        Ok(list.nodes)
    }

    /// `POST /v1/nodes/tokens`: a one-time token for a node to join with.
    pub async fn create_join_token(
        &self,
        req: &crate::node::CreateJoinToken,
    ) -> Result<crate::node::JoinToken> {
        self.json(Self::with_json(
            self.request(Method::POST, "/v1/nodes/tokens"),
            req,
        ))
        .await
    }

    /// `DELETE /v1/nodes/{id}`: the node leaves the cluster; its certificate is refused.
    pub async fn remove_node(&self, id: &str) -> Result<()> {
        self.empty(self.request(Method::DELETE, &format!("/v1/nodes/{id}")))
            .await
    }

    /// `POST /v1/sandboxes/{id}/migrate`: moves the sandbox to another node (`req.to`, or
    /// the one the scheduler picks) and says how it went.
    pub async fn migrate_sandbox(
        &self,
        id: &str,
        req: &crate::node::MigrateRequest,
    ) -> Result<crate::node::Migration> {
        self.json(Self::with_json(
            self.request(Method::POST, &format!("/v1/sandboxes/{id}/migrate")),
            req,
        ))
        .await
    }

    /// `POST /v1/nodes/{id}/drain` (`draining`) or `DELETE` (not): whether nothing new is
    /// placed on the node, and the sandboxes still on it.
    pub async fn drain_node(&self, id: &str, draining: bool) -> Result<crate::node::Drain> {
        let method = if draining {
            Method::POST
        } else {
            Method::DELETE
        };
        self.json(self.request(method, &format!("/v1/nodes/{id}/drain")))
            .await
    }

    /// `GET /v1/cluster`: the nodes summed, and the sandboxes by state.
    pub async fn cluster_status(&self) -> Result<crate::node::ClusterStatus> {
        self.json(self.request(Method::GET, "/v1/cluster")).await
    }

    /// `GET /v1/pools`: every template's pool (templates without one are not listed).
    pub async fn list_pools(&self) -> Result<Vec<Pool>> {
        let list: PoolList = self.json(self.request(Method::GET, "/v1/pools")).await?;
        Ok(list.pools)
    }

    /// `GET /v1/templates/{name}/pool`.
    pub async fn get_pool(&self, template: &str) -> Result<Pool> {
        self.json(self.request(Method::GET, &format!("/v1/templates/{template}/pool")))
            .await
    }

    /// `PUT /v1/templates/{name}/pool`: sets the pool's sizes; the answer says whether they
    /// were clamped (`warning`).
    pub async fn set_pool(&self, template: &str, req: &SetPool) -> Result<Pool> {
        self.json(Self::with_json(
            self.request(Method::PUT, &format!("/v1/templates/{template}/pool")),
            req,
        ))
        .await
    }
}
