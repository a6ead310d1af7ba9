//! `space node ls` and `space cluster status` (issue 14): the nodes, their capacity and what
//! their sandboxes claim. An all-in-one spaced has one node, itself.

use anyhow::Result;
use clap::Subcommand;
use space_api::{Client, ClusterStatus, Node, NodeList};

#[derive(Debug, Subcommand)]
pub enum NodeCmd {
    /// List the nodes: state, runtimes, CPUs and memory, and what their sandboxes claim.
    Ls {
        #[arg(long)]
        json: bool,
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
            n.name,
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
    }
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
        };
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
