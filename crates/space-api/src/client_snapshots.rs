//! Client calls for snapshots, rollback and fork (a child of `client`, sharing its helpers).

use reqwest::Method;

use super::{Client, Result};
use crate::snapshot::{CreateSnapshot, ForkRequest, RollbackRequest, Snapshot, SnapshotList};
use crate::types::{Sandbox, SandboxList};

impl Client {
    /// `POST /v1/sandboxes/{id}/snapshots`.
    pub async fn create_snapshot(&self, id: &str, label: Option<&str>) -> Result<Snapshot> {
        let body = CreateSnapshot {
            label: label.map(str::to_string),
            kind: None,
        };
        self.create_snapshot_with(id, &body).await
    }

    /// `POST /v1/sandboxes/{id}/snapshots` with any body (e.g. `kind: checkpoint`).
    pub async fn create_snapshot_with(&self, id: &str, body: &CreateSnapshot) -> Result<Snapshot> {
        self.json(Self::with_json(
            self.request(Method::POST, &format!("/v1/sandboxes/{id}/snapshots")),
            body,
        ))
        .await
    }

    /// `GET /v1/sandboxes/{id}/snapshots`, oldest first.
    pub async fn list_snapshots(&self, id: &str) -> Result<Vec<Snapshot>> {
        Ok(self.snapshot_list(id).await?.snapshots)
    }

    /// `GET /v1/sandboxes/{id}/snapshots`, whole: the snapshots, the head and the forks.
    pub async fn snapshot_list(&self, id: &str) -> Result<SnapshotList> {
        self.json(self.request(Method::GET, &format!("/v1/sandboxes/{id}/snapshots")))
            .await
    }

    /// `DELETE /v1/sandboxes/{id}/snapshots/{snap}`.
    pub async fn delete_snapshot(&self, id: &str, snap: &str) -> Result<()> {
        self.empty(self.request(
            Method::DELETE,
            &format!("/v1/sandboxes/{id}/snapshots/{snap}"),
        ))
        .await
    }

    /// `POST /v1/sandboxes/{id}/rollback`.
    pub async fn rollback(&self, id: &str, snap: &str) -> Result<Sandbox> {
        let body = RollbackRequest {
            snapshot: snap.to_string(),
        };
        self.json(Self::with_json(
            self.request(Method::POST, &format!("/v1/sandboxes/{id}/rollback")),
            &body,
        ))
        .await
    }

    /// `POST /v1/sandboxes/{id}/fork`: the new sandboxes.
    pub async fn fork(&self, id: &str, req: &ForkRequest) -> Result<Vec<Sandbox>> {
        let list: SandboxList = self
            .json(Self::with_json(
                self.request(Method::POST, &format!("/v1/sandboxes/{id}/fork")),
                req,
            ))
            .await?;
        Ok(list.sandboxes)
    }

    /// `PUT /v1/sandboxes/{id}/snapshot-policy`: replaces the sandbox's snapshot policy.
    pub async fn set_snapshot_policy(
        &self,
        id: &str,
        policy: &crate::snapshot_policy::SnapshotPolicy,
    ) -> Result<Sandbox> {
        self.json(Self::with_json(
            self.request(Method::PUT, &format!("/v1/sandboxes/{id}/snapshot-policy")),
            policy,
        ))
        .await
    }
}
