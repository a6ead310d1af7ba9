//! Client call for change tracking (a child of `client`, sharing its helpers).

use reqwest::Method;

use super::{Client, Result};
use crate::diff::{DiffEntry, DiffList};

impl Client {
    /// `GET /v1/sandboxes/{id}/diff?from=&to=`: `from` None = the sandbox's creation, `to`
    /// None = the live filesystem.
    pub async fn diff(
        &self,
        id: &str,
        from: Option<&str>,
        to: Option<&str>,
    ) -> Result<Vec<DiffEntry>> {
        let mut q: Vec<(&str, &str)> = Vec::new();
        if let Some(f) = from {
            q.push(("from", f));
        }
        if let Some(t) = to {
            q.push(("to", t));
        }
        let list: DiffList = self
            .json(
                self.request(Method::GET, &format!("/v1/sandboxes/{id}/diff"))
                    .query(&q),
            )
            .await?;
        Ok(list.changes)
    }
}
