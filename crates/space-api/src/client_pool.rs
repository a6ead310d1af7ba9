//! Client calls for warm pools (a child of `client`, sharing its helpers).

use reqwest::Method;

use super::{Client, Result};
use crate::pool::{Pool, PoolList, SetPool};

impl Client {
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
