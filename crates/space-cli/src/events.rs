//! `space events ID [--json] [--limit N] [--after ID]`.

use anyhow::Result;
use clap::Args;
use space_api::{Client, EventList};

#[derive(Debug, Args)]
pub struct EventsArgs {
    id: String,
    #[arg(long)]
    json: bool,
    /// At most this many (server default 100).
    #[arg(long)]
    limit: Option<u32>,
    /// Only events after this event id.
    #[arg(long)]
    after: Option<i64>,
}

pub async fn run(c: Client, a: EventsArgs) -> Result<i32> {
    let events = c.events(&a.id, a.limit, a.after).await?;
    if a.json {
        crate::print_json(&EventList { events })?;
        return Ok(0);
    }
    for e in events {
        let secs = e.time / 1000;
        let (h, m, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
        println!(
            "{} {h:02}:{m:02}:{s:02}.{:03}Z {:<18} {:<16} {:<12} {}",
            e.id,
            e.time % 1000,
            e.actor,
            e.action,
            e.result,
            e.detail
        );
    }
    Ok(0)
}
