//! `space node ls`, `space node token`, `space node rm` and `space cluster status` (issue 14):
//! the nodes, their capacity and what their sandboxes claim, and how nodes join and leave a
//! `spaced control`. An all-in-one spaced has one node, itself.

use anyhow::Result;
use clap::Subcommand;
use space_api::{Client, ClusterStatus, CreateJoinToken, Node, NodeList};

#[derive(Debug, Subcommand)]
pub enum NodeCmd {
    /// List the nodes: state, runtimes, CPUs and memory, and what their sandboxes claim.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// A one-time token for a node to join this control plane with (printed with the
    /// `spaced node` command that uses it).
    Token {
        /// How long it is good for, in seconds (at most a day).
        #[arg(long, default_value_t = 3600)]
        ttl: u64,
        #[arg(long)]
        json: bool,
    },
    /// Remove a node from the cluster: its certificate is refused from now on.
    Rm { id: String },
    /// Move every sandbox off a node, one at a time; nothing new is placed on it meanwhile
    /// or after (until `--undo`). Run it again to retry the ones that did not move.
    Drain {
        id: String,
        /// End the drain: the node takes new sandboxes again.
        #[arg(long)]
        undo: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum ClusterCmd {
    /// The nodes summed, and every sandbox counted by state.
    Status {
        #[arg(long)]
        json: bool,
    },
}

fn gib(bytes: u64) -> String {
    format!("{:.1}G", bytes as f64 / (1u64 << 30) as f64)
}

/// The table of `space node ls`.
pub fn table(nodes: &[Node]) -> String {
    let mut out = vec![format!(
        "{:<20}  {:<11}  {:<17}  {:>4}  {:>8}  {:>8}  {:>9}  {:>9}  {:>9}  {:>10}",
        "NAME",
        "STATE",
        "RUNTIMES",
        "CPUS",
        "MEMORY",
        "FREE",
        "SANDBOXES",
        "POOLED",
        "CPU USED",
        "MEM USED"
    )];
    for n in nodes {
        out.push(format!(
            "{:<20}  {:<11}  {:<17}  {:>4}  {:>8}  {:>8}  {:>9}  {:>9}  {:>9}  {:>10}",
            match &n.id {
                Some(id) => format!("{} ({id})", n.name),
                None => n.name.clone(),
            },
            n.state,
            n.runtimes.join(","),
            n.cpus,
            gib(n.memory_bytes),
            gib(n.memory_available_bytes),
            n.sandboxes,
            n.pool_ready,
            format!("{:.2}", n.allocated_cpu),
            format!("{}M", n.allocated_memory_mib),
        ));
    }
    out.join("\n")
}

/// The lines of `space cluster status`.
pub fn summary(c: &ClusterStatus) -> String {
    let states: Vec<String> = c
        .sandboxes
        .iter()
        .map(|(state, n)| format!("{n} {state}"))
        .collect();
    [
        format!("nodes:      {} ({} ready)", c.nodes, c.nodes_ready),
        format!(
            "capacity:   {} CPUs, {} memory ({} free)",
            c.cpus,
            gib(c.memory_bytes),
            gib(c.memory_available_bytes)
        ),
        format!(
            "claimed:    {:.2} CPUs, {}M memory (limits of creating, running and paused sandboxes)",
            c.allocated_cpu, c.allocated_memory_mib
        ),
        format!(
            "sandboxes:  {}",
            if states.is_empty() {
                "none".to_owned()
            } else {
                states.join(", ")
            }
        ),
        format!("warm pools: {} ready", c.pool_ready),
    ]
    .join("\n")
}

/// What `space migrate` prints.
pub fn migration_line(m: &space_api::Migration) -> String {
    let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64);
    format!(
        "{} moved from node {} to node {} in {} ms (down {} ms); sent {} while it ran{}, {} \
         while paused; now {}{}",
        m.sandbox_id,
        m.from,
        m.to,
        m.total_ms,
        m.downtime_ms,
        mib(m.base_bytes),
        match m.reused_snapshots.len() {
            0 => String::new(),
            n => format!(" ({n} snapshots were there already, in its replica)"),
        },
        mib(m.final_bytes),
        m.sandbox.state,
        if m.processes_restarted {
            " (its processes started again)"
        } else {
            ""
        }
    )
}

pub async fn run_node(c: Client, cmd: NodeCmd) -> Result<i32> {
    match cmd {
        NodeCmd::Ls { json } => {
            let nodes = c.list_nodes().await?;
            if json {
                crate::print_json(&NodeList { nodes })?;
            } else {
                println!("{}", table(&nodes));
            }
        }
        NodeCmd::Token { ttl, json } => {
            let t = c
                .create_join_token(&CreateJoinToken {
                    ttl_secs: Some(ttl),
                })
                .await?;
            if json {
                crate::print_json(&t)?;
            } else {
                println!("{}", t.token);
                eprintln!("valid until {}, once; on the new node:", t.expires_at);
                eprintln!("  {}", t.join_command);
            }
        }
        NodeCmd::Rm { id } => c.remove_node(&id).await?,
        NodeCmd::Drain { id, undo: true } => {
            c.drain_node(&id, false).await?;
            println!("node {id} takes new sandboxes again");
        }
        NodeCmd::Drain { id, undo: false } => return drain(&c, &id).await,
    }
    Ok(0)
}

/// `space node drain`: each sandbox moved in turn, a line for each as it goes.
async fn drain(c: &Client, id: &str) -> Result<i32> {
    let d = c.drain_node(id, true).await?;
    let total = d.sandboxes.len();
    eprintln!("node {id} is drained: nothing new goes there; {total} sandbox(es) to move");
    let mut failed = 0;
    for (i, sb) in d.sandboxes.iter().enumerate() {
        eprint!("[{}/{total}] moving {sb}... ", i + 1);
        match c
            .migrate_sandbox(sb, &space_api::MigrateRequest::default())
            .await
        {
            Ok(m) => eprintln!("{}", migration_line(&m)),
            Err(e) => {
                failed += 1;
                eprintln!("failed: {e}");
            }
        }
    }
    if failed > 0 {
        eprintln!("{failed} of {total} did not move; `space node drain {id}` tries them again");
        return Ok(1);
    }
    println!("node {id} holds no sandboxes");
    Ok(0)
}

pub async fn run_cluster(c: Client, cmd: ClusterCmd) -> Result<i32> {
    match cmd {
        ClusterCmd::Status { json } => {
            let status = c.cluster_status().await?;
            if json {
                crate::print_json(&status)?;
            } else {
                println!("{}", summary(&status));
            }
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_show_what_the_api_says() {
        let n = Node {
            name: "host-a".into(),
            state: "ready".into(),
            runtimes: vec!["namespace".into(), "microvm".into()],
            cpus: 2,
            memory_bytes: 24 << 30,
            memory_available_bytes: 20 << 30,
            sandboxes: 3,
            pool_ready: 4,
            allocated_cpu: 3.0,
            allocated_memory_mib: 1536,
            ..Node::default()
        };
        let joined = Node {
            id: Some("k3j9x0a1b2c3".into()),
            ..n.clone()
        };
        assert!(table(&[joined]).contains("host-a (k3j9x0a1b2c3)"));
        let t = table(&[n]);
        let line = t.lines().nth(1).unwrap();
        for part in [
            "host-a",
            "ready",
            "namespace,microvm",
            "24.0G",
            "20.0G",
            "3.00",
            "1536M",
        ] {
            assert!(line.contains(part), "{part} in {line}");
        }
        let s = summary(&ClusterStatus {
            nodes: 1,
            nodes_ready: 1,
            cpus: 2,
            memory_bytes: 24 << 30,
            memory_available_bytes: 20 << 30,
            allocated_cpu: 3.0,
            allocated_memory_mib: 1536,
            pool_ready: 4,
            sandboxes: [("paused".to_owned(), 1), ("running".to_owned(), 2)].into(),
        });
        assert!(
            s.contains("1 (1 ready)") && s.contains("1 paused, 2 running"),
            "{s}"
        );
    }
}
