//! `space snapshot`, `snapshots`, `snapshot-rm`, `rollback`, `fork`.
//!
//! Layout: `space snapshot ID` takes a snapshot, so removal cannot be a subcommand of it
//! (`space snapshot rm` would parse `rm` as an id); it is `space snapshot-rm ID SNAP`.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Result;
use clap::Subcommand;
use space_api::{Client, CreateSnapshot, ForkRequest, Snapshot, SnapshotKind, SnapshotPolicy};

#[derive(Debug, Subcommand)]
pub enum SnapCmd {
    /// Take a disk snapshot (or with --checkpoint, a checkpoint) of a sandbox and print its
    /// id.
    Snapshot {
        id: String,
        #[arg(long)]
        label: Option<String>,
        /// Also record the running processes, restarted (from scratch: memory is not kept)
        /// after a rollback, recovery or fork from it.
        #[arg(long)]
        checkpoint: bool,
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
    /// Change a sandbox's snapshot policy (options not given stay as they are) and print
    /// the resulting policy as JSON.
    SnapshotPolicy(PolicyArgs),
}

#[derive(Debug, clap::Args)]
pub struct PolicyArgs {
    id: String,
    /// Automatic snapshot every SECS seconds while its files change.
    #[arg(long, value_name = "SECS", conflicts_with = "no_every")]
    every: Option<u64>,
    #[arg(long)]
    no_every: bool,
    /// Automatic snapshot after every foreground exec.
    #[arg(long, conflicts_with = "no_after_exec")]
    after_exec: bool,
    #[arg(long)]
    no_after_exec: bool,
    /// Keep only the newest K automatic snapshots.
    #[arg(long, value_name = "K", conflicts_with = "no_keep_last")]
    keep_last: Option<u32>,
    /// Keep every automatic snapshot.
    #[arg(long)]
    no_keep_last: bool,
    /// Retention never deletes labelled snapshots (the default).
    #[arg(long, conflicts_with = "no_keep_labelled")]
    keep_labelled: bool,
    /// Labelled snapshots count towards --keep-last.
    #[arg(long)]
    no_keep_labelled: bool,
    /// Remove the policy (snapshots on demand only).
    #[arg(long)]
    clear: bool,
}

/// The policy after applying `a` to `cur`.
pub fn merge_policy(cur: Option<SnapshotPolicy>, a: &PolicyArgs) -> SnapshotPolicy {
    if a.clear {
        return SnapshotPolicy::default();
    }
    let mut p = cur.unwrap_or_default();
    if a.every.is_some() || a.no_every {
        p.every_secs = a.every;
    }
    if a.after_exec || a.no_after_exec {
        p.after_exec = a.after_exec;
    }
    if a.keep_last.is_some() || a.no_keep_last {
        p.keep_last = a.keep_last;
    }
    if a.keep_labelled || a.no_keep_labelled {
        p.keep_labelled = a.keep_labelled;
    }
    p
}

pub async fn run(c: Client, cmd: SnapCmd) -> Result<i32> {
    match cmd {
        SnapCmd::Snapshot {
            id,
            label,
            checkpoint,
        } => {
            let body = CreateSnapshot {
                label,
                kind: checkpoint.then_some(SnapshotKind::Checkpoint),
            };
            let s = c.create_snapshot_with(&id, &body).await?;
            println!("{}", s.id);
        }
        SnapCmd::Snapshots { id, json } => {
            let list = c.snapshot_list(&id).await?;
            if json {
                crate::print_json(&list)?;
            } else {
                print!("{}", render_tree(&list.snapshots));
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
        SnapCmd::SnapshotPolicy(a) => {
            let cur = c.get_sandbox(&a.id).await?.snapshot_policy;
            let sb = c.set_snapshot_policy(&a.id, &merge_policy(cur, &a)).await?;
            crate::print_json(&sb.snapshot_policy.unwrap_or_default())?;
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
        let kind = match (&s.processes, s.kind) {
            (Some(p), SnapshotKind::Checkpoint) if s.memory => {
                format!("checkpoint({}, memory)", p.len())
            }
            (Some(p), SnapshotKind::Checkpoint) => format!("checkpoint({})", p.len()),
            (_, k) => k.as_str().to_string(),
        };
        out.push_str(&format!(
            "{:indent$}{}  {}  {}  {}  {}{}\n",
            "",
            s.id,
            s.created_at,
            kind,
            size,
            s.label
                .as_deref()
                .unwrap_or(if s.auto { "(auto)" } else { "" }),
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

    fn s(id: &str, parent: Option<&str>) -> Snapshot {
        Snapshot {
            id: id.into(),
            sandbox_id: "x".into(),
            parent_id: parent.map(str::to_string),
            label: None,
            created_at: "t".into(),
            size_bytes: None,
            kind: SnapshotKind::Disk,
            auto: false,
            processes: None,
            memory: false,
        }
    }

    #[test]
    fn policy_flags_change_only_what_they_name() {
        use clap::Parser;
        #[derive(Parser)]
        struct T {
            #[command(flatten)]
            a: PolicyArgs,
        }
        let args = |v: &[&str]| {
            T::try_parse_from(std::iter::once("t").chain(v.iter().copied()))
                .unwrap()
                .a
        };
        let cur = SnapshotPolicy {
            every_secs: Some(5),
            after_exec: true,
            keep_last: Some(3),
            keep_labelled: true,
        };
        let p = merge_policy(Some(cur.clone()), &args(&["x", "--keep-last", "7"]));
        assert_eq!(p.keep_last, Some(7));
        assert_eq!((p.every_secs, p.after_exec), (Some(5), true));
        let p = merge_policy(
            Some(cur.clone()),
            &args(&["x", "--no-every", "--no-after-exec", "--no-keep-labelled"]),
        );
        assert_eq!(
            (p.every_secs, p.after_exec, p.keep_labelled),
            (None, false, false)
        );
        assert_eq!(p.keep_last, Some(3));
        assert!(merge_policy(Some(cur), &args(&["x", "--clear"])).is_empty());
        assert!(T::try_parse_from(["t", "x", "--every", "1", "--no-every"]).is_err());
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
        assert!(lines[0].contains("  disk  "), "{t}");
        let mut cp = s("f", None);
        cp.kind = SnapshotKind::Checkpoint;
        cp.processes = Some(vec![space_api::CheckpointProcess::default()]);
        assert!(render_tree(std::slice::from_ref(&cp)).contains("  checkpoint(1)  "));
        cp.memory = true;
        assert!(render_tree(&[cp]).contains("  checkpoint(1, memory)  "));
        assert!(lines[1].starts_with("  b "));
        assert!(lines[2].starts_with("    d "));
        assert!(lines[3].starts_with("  c "));
        assert!(lines[4].starts_with("e ") && lines[4].ends_with("(from zz)"));
    }
}
