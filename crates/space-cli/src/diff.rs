//! `space diff ID [SNAP_A [SNAP_B]] [--json]` (decision 0011).

use anyhow::Result;
use clap::Args;
use space_api::{Client, DiffEntry, DiffList};

#[derive(Debug, Args)]
pub struct DiffArgs {
    pub id: String,
    /// Base snapshot (default: the sandbox's creation).
    pub from: Option<String>,
    /// Target snapshot (default: the live filesystem).
    pub to: Option<String>,
    #[arg(long)]
    pub json: bool,
}

/// `A /path`, `M /path`, `D /path`, one a line, sorted by path.
pub fn render(changes: &[DiffEntry]) -> String {
    let mut lines: Vec<(String, char)> = changes
        .iter()
        .map(|c| {
            let k = match c.change.as_str() {
                "added" => 'A',
                "deleted" => 'D',
                _ => 'M',
            };
            (c.path.clone(), k)
        })
        .collect();
    lines.sort();
    lines.iter().map(|(p, k)| format!("{k} {p}\n")).collect()
}

pub async fn run(c: Client, a: DiffArgs) -> Result<i32> {
    let changes = c.diff(&a.id, a.from.as_deref(), a.to.as_deref()).await?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&DiffList { changes })?);
    } else {
        print!("{}", render(&changes));
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_sorted_letters() {
        let e = |p: &str, c: &str| DiffEntry {
            path: p.into(),
            change: c.into(),
            kind: "file".into(),
            text_diff: None,
        };
        let out = render(&[e("/b", "deleted"), e("/a", "added"), e("/c", "modified")]);
        assert_eq!(out, "A /a\nD /b\nM /c\n");
    }
}
