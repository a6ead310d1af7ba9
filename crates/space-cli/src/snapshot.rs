//! `space snapshot`, `snapshots`, `snapshot-rm`, `rollback`, `fork`.
//!
//! Layout: `space snapshot ID` takes a snapshot, so removal cannot be a subcommand of it
//! (`space snapshot rm` would parse `rm` as an id); it is `space snapshot-rm ID SNAP`.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Result;
use clap::Subcommand;
use space_api::{Client, ForkRequest, Snapshot, SnapshotList};

#[derive(Debug, Subcommand)]
pub enum SnapCmd {
    /// Take a disk snapshot of a sandbox and print its id.
    Snapshot {
        id: String,
        #[arg(long)]
        label: Option<String>,
    },
    /// List a sandbox's snapshots as a tree (indented by parent).
    Snapshots {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Delete a snapshot.
    SnapshotRm { id: String, snap: String },
    /// Put a sandbox back on one of its snapshots (its processes restart).
    Rollback { id: String, snap: String },
    /// Create sandboxes from a snapshot (default: snapshot the live state first); prints
    /// the new ids, one per line.
    Fork {
        id: String,
        #[arg(long)]
        snapshot: Option<String>,
        #[arg(long, default_value_t = 1)]
        count: u32,
    },
}

pub async fn run(c: Client, cmd: SnapCmd) -> Result<i32> {
    match cmd {
        SnapCmd::Snapshot { id, label } => {
            let s = c.create_snapshot(&id, label.as_deref()).await?;
            println!("{}", s.id);
        }
        SnapCmd::Snapshots { id, json } => {
            let list = c.list_snapshots(&id).await?;
            if json {
                crate::print_json(&SnapshotList { snapshots: list })?;
            } else {
                print!("{}", render_tree(&list));
            }
        }
        SnapCmd::SnapshotRm { id, snap } => c.delete_snapshot(&id, &snap).await?,
        SnapCmd::Rollback { id, snap } => {
            c.rollback(&id, &snap).await?;
        }
        SnapCmd::Fork {
            id,
            snapshot,
            count,
        } => {
            let forks = c
                .fork(
                    &id,
                    &ForkRequest {
                        snapshot,
                        count: Some(count),
                    },
                )
                .await?;
            for f in forks {
                println!("{}", f.id);
            }
        }
    }
    Ok(0)
}

/// One line per snapshot, children indented under their parent (two spaces per level);
/// a snapshot whose parent is not in the list (another sandbox's) is a root.
pub fn render_tree(list: &[Snapshot]) -> String {
    let ids: BTreeSet<&str> = list.iter().map(|s| s.id.as_str()).collect();
    let mut children: BTreeMap<Option<&str>, Vec<&Snapshot>> = BTreeMap::new();
    for s in list {
        let parent = s.parent_id.as_deref().filter(|p| ids.contains(p));
        children.entry(parent).or_default().push(s);
    }
    let mut out = String::new();
    let mut stack: Vec<(&Snapshot, usize)> = children
        .get(&None)
        .map(|v| v.iter().rev().map(|s| (*s, 0)).collect())
        .unwrap_or_default();
    while let Some((s, depth)) = stack.pop() {
        let size = s
            .size_bytes
            .map(|b| format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0)))
            .unwrap_or_else(|| "-".into());
        out.push_str(&format!(
            "{:indent$}{}  {}  {}  {}{}\n",
            "",
            s.id,
            s.created_at,
            size,
            s.label.as_deref().unwrap_or(""),
            s.parent_id
                .as_deref()
                .filter(|p| !ids.contains(p))
                .map(|p| format!("  (from {p})"))
                .unwrap_or_default(),
            indent = depth * 2
        ));
        if let Some(kids) = children.get(&Some(s.id.as_str())) {
            stack.extend(kids.iter().rev().map(|k| (*k, depth + 1)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use space_api::SnapshotKind;

    fn s(id: &str, parent: Option<&str>) -> Snapshot {
        Snapshot {
            id: id.into(),
            sandbox_id: "x".into(),
            parent_id: parent.map(str::to_string),
            label: None,
            created_at: "t".into(),
            size_bytes: None,
            kind: SnapshotKind::Disk,
        }
    }

    #[test]
    fn tree_is_indented_by_parent() {
        let list = [
            s("a", None),
            s("b", Some("a")),
            s("c", Some("a")),
            s("d", Some("b")),
            s("e", Some("zz")),
        ];
        let t = render_tree(&list);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 5);
        assert!(lines[0].starts_with("a "));
        assert!(lines[1].starts_with("  b "));
        assert!(lines[2].starts_with("    d "));
        assert!(lines[3].starts_with("  c "));
        assert!(lines[4].starts_with("e ") && lines[4].ends_with("(from zz)"));
    }
}
