//! Client call for events (a child of `client`, sharing its helpers).

use reqwest::Method;

use super::{Client, Result};
use crate::event::{Event, EventList};

impl Client {
    /// `GET /v1/sandboxes/{id}/events`, oldest first.
    pub async fn events(
        &self,
        id: &str,
        limit: Option<u32>,
        after: Option<i64>,
    ) -> Result<Vec<Event>> {
        let mut path = format!("/v1/sandboxes/{id}/events?");
        if let Some(l) = limit {
            path.push_str(&format!("limit={l}&"));
        }
        if let Some(a) = after {
            path.push_str(&format!("after={a}&"));
        }
        let list: EventList = self
            .json(self.request(Method::GET, path.trim_end_matches(['?', '&'])))
            .await?;
        Ok(list.events)
    }
}
