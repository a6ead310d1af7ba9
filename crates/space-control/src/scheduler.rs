//! Where a new sandbox goes (issue 14, decision 0034): a pure function of the nodes' last
//! reports and what their sandboxes claim, so it can be tested and measured alone.
//!
//! A node is a candidate when it is reachable, offers the runtime, has the template (until
//! templates are sent to nodes on demand), and still has room for the sandbox's limits within
//! its claimable capacity: [`CPU_OVERCOMMIT`] times its cores and [`MEMORY_OVERCOMMIT`] times
//! its memory (limits are ceilings, not use: an idle sandbox uses a few MiB of its 512).
//! Among candidates, the best is the first by:
//! 1. a ready member in the template's warm pool (a create then costs milliseconds);
//! 2. the larger free share of claimable memory, then of CPU, in steps of 5% (spreads the
//!    load; nodes within a step are equal here);
//! 3. a hash of the sandbox's id and the node's (rendezvous hashing): equal nodes are each
//!    some sandboxes' first choice, so that creates placed at once by several replicas do not
//!    all reach for the same node and retry, while one sandbox always gets the same answer.

use std::cmp::Ordering;

use space_node_api::RuntimeKind;

/// Claimable CPU: this many times the node's cores, in limits (a CPU limit is a quota, not a
/// reservation: a 2-core node takes 128 sandboxes of the default one core).
pub const CPU_OVERCOMMIT: u64 = 64;
/// Claimable memory: this many times the node's memory, in limits (a 24 GiB node takes 384
/// sandboxes of the default 512 MiB; an idle one uses about 2.5 MiB).
pub const MEMORY_OVERCOMMIT: u64 = 8;

/// A node as the scheduler sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub id: String,
    pub reachable: bool,
    pub runtimes: Vec<RuntimeKind>,
    pub cpus: u32,
    pub memory_bytes: u64,
    /// The limits its creating, running and paused sandboxes hold.
    pub claimed_cpu_millis: u64,
    pub claimed_memory_mib: u64,
    /// Whether it has the template (any version).
    pub has_template: bool,
    /// Whether another reachable node has the template, to send it here on demand
    /// (decision 0035): a node without it is then a candidate, after those that have it.
    pub template_elsewhere: bool,
    /// Ready members in the template's warm pool there.
    pub pool_ready: u32,
    /// Being drained (`space node drain`): nothing new goes there.
    pub draining: bool,
}

/// What a sandbox needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Need {
    pub cpu_millis: u64,
    pub memory_mib: u64,
    pub runtime: RuntimeKind,
}

impl Need {
    /// What the sandbox of `spec` needs: its limits and runtime.
    pub fn of(spec: &space_node_api::SandboxSpec) -> Self {
        Self {
            cpu_millis: u64::from(spec.limits.cpu_millis),
            memory_mib: spec.limits.memory_mib,
            runtime: spec.runtime.unwrap_or_default(),
        }
    }
}

/// The chosen node and why, for the sandbox's events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub node: String,
    pub reason: String,
}

impl Candidate {
    pub(crate) fn cpu_capacity(&self) -> u64 {
        u64::from(self.cpus) * 1000 * CPU_OVERCOMMIT
    }

    pub(crate) fn memory_capacity_mib(&self) -> u64 {
        (self.memory_bytes >> 20) * MEMORY_OVERCOMMIT
    }

    /// Whether `need` fits in what it has left (whatever else it lacks).
    pub fn fits(&self, need: &Need) -> bool {
        self.claimed_memory_mib + need.memory_mib <= self.memory_capacity_mib()
            && self.claimed_cpu_millis + need.cpu_millis <= self.cpu_capacity()
    }

    /// Why it cannot take `need`, if it cannot.
    fn refuses(&self, need: &Need) -> Option<&'static str> {
        if !self.reachable {
            Some("unreachable")
        } else if self.draining {
            Some("draining")
        } else if !self.runtimes.contains(&need.runtime) {
            Some("lacks the runtime")
        } else if !self.has_template && !self.template_elsewhere {
            Some("lacks the template")
        } else if self.claimed_memory_mib + need.memory_mib > self.memory_capacity_mib() {
            Some("memory fully claimed")
        } else if self.claimed_cpu_millis + need.cpu_millis > self.cpu_capacity() {
            Some("CPU fully claimed")
        } else {
            None
        }
    }

    /// Free share of claimable memory and CPU after `need`, in millionths.
    fn free_after(&self, need: &Need) -> (u64, u64) {
        let share = |cap: u64, used: u64| {
            (cap.saturating_sub(used) * 1_000_000)
                .checked_div(cap)
                .unwrap_or(0)
        };
        (
            share(
                self.memory_capacity_mib(),
                self.claimed_memory_mib + need.memory_mib,
            ),
            share(
                self.cpu_capacity(),
                self.claimed_cpu_millis + need.cpu_millis,
            ),
        )
    }
}

/// Free shares in steps of this many millionths (5%).
const FREE_STEP: u64 = 50_000;

fn rendezvous(key: &str, node: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys: the same order on every replica and every run.
    let mut h = std::hash::DefaultHasher::new();
    (key, node).hash(&mut h);
    h.finish()
}

/// Better first.
fn rank(a: &Candidate, b: &Candidate, need: &Need, key: &str) -> Ordering {
    let free = |n: &Candidate| {
        let (mem, cpu) = n.free_after(need);
        (mem / FREE_STEP, cpu / FREE_STEP)
    };
    (b.pool_ready > 0)
        .cmp(&(a.pool_ready > 0))
        .then_with(|| b.has_template.cmp(&a.has_template))
        .then_with(|| free(b).cmp(&free(a)))
        .then_with(|| rendezvous(key, &a.id).cmp(&rendezvous(key, &b.id)))
        .then_with(|| a.id.cmp(&b.id))
}

/// The node for sandbox `key` that needs `need`, or why there is none (each node's reason).
pub fn place(nodes: &[Candidate], need: &Need, key: &str) -> Result<Placement, String> {
    let best = nodes
        .iter()
        .filter(|n| n.refuses(need).is_none())
        .min_by(|a, b| rank(a, b, need, key));
    let Some(n) = best else {
        if nodes.is_empty() {
            return Err("no node has joined".into());
        }
        let mut why: Vec<String> = nodes
            .iter()
            .take(5)
            .map(|n| format!("{}: {}", n.id, n.refuses(need).unwrap_or("?")))
            .collect();
        if nodes.len() > 5 {
            why.push(format!("and {} more", nodes.len() - 5));
        }
        return Err(format!("no node can take it ({})", why.join("; ")));
    };
    let (mem, cpu) = n.free_after(need);
    let first = if n.pool_ready > 0 {
        format!("{} ready in the template's warm pool", n.pool_ready)
    } else if !n.has_template {
        "the template will be sent from another node".to_owned()
    } else {
        "no ready pool member".to_owned()
    };
    Ok(Placement {
        node: n.id.clone(),
        reason: format!(
            "{first}; {}% of claimable memory and {}% of CPU free after it",
            mem / 10_000,
            cpu / 10_000
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str) -> Candidate {
        Candidate {
            id: id.into(),
            reachable: true,
            runtimes: vec![RuntimeKind::Namespace],
            cpus: 2,
            memory_bytes: 8 << 30,
            claimed_cpu_millis: 0,
            claimed_memory_mib: 0,
            has_template: true,
            template_elsewhere: false,
            pool_ready: 0,
            draining: false,
        }
    }

    const NEED: Need = Need {
        cpu_millis: 1000,
        memory_mib: 512,
        runtime: RuntimeKind::Namespace,
    };

    #[test]
    fn a_warm_pool_beats_free_room_and_the_template_is_required() {
        let mut a = node("a");
        let mut b = node("b");
        b.pool_ready = 1;
        b.claimed_memory_mib = 20_000;
        let p = place(&[a.clone(), b.clone()], &NEED, "s1").unwrap();
        assert_eq!(p.node, "b");
        assert!(
            p.reason.starts_with("1 ready in the template's warm pool"),
            "{}",
            p.reason
        );
        b.pool_ready = 0;
        a.has_template = false;
        let p = place(&[a.clone(), b.clone()], &NEED, "s1").unwrap();
        assert_eq!(p.node, "b");
        assert!(p.reason.starts_with("no ready pool member"), "{}", p.reason);
        let e = place(&[a.clone()], &NEED, "s1").unwrap_err();
        assert!(e.contains("a: lacks the template"), "{e}");
        // Another node has it, so it can be sent: a node without it may take the sandbox,
        // after every node that has it (a fuller one included).
        a.template_elsewhere = true;
        let mut fuller = b.clone();
        fuller.claimed_memory_mib = 4 << 10;
        assert_eq!(place(&[a.clone(), fuller], &NEED, "s1").unwrap().node, "b");
        let p = place(&[a.clone()], &NEED, "s1").unwrap();
        assert_eq!(p.node, "a");
        assert!(
            p.reason.starts_with("the template will be sent"),
            "{}",
            p.reason
        );
        a.template_elsewhere = false;
        // The freer node by a step or more; within a step, each sandbox's own choice.
        let (c, mut d) = (node("c"), node("d"));
        d.claimed_memory_mib = 8 << 10;
        for key in ["s1", "s2", "s3", "s4"] {
            assert_eq!(
                place(&[d.clone(), c.clone()], &NEED, key).unwrap().node,
                "c"
            );
        }
        d.claimed_memory_mib = 512;
        let picks: std::collections::BTreeSet<String> = (0..32)
            .map(|i| {
                place(&[d.clone(), c.clone()], &NEED, &format!("s{i}"))
                    .unwrap()
                    .node
            })
            .collect();
        assert_eq!(
            picks.len(),
            2,
            "equal nodes were not both chosen: {picks:?}"
        );
        let again = place(&[c.clone(), d.clone()], &NEED, "s7").unwrap().node;
        assert_eq!(place(&[d, c], &NEED, "s7").unwrap().node, again);
    }

    #[test]
    fn full_unreachable_and_wrong_runtime_nodes_are_never_chosen() {
        let mut full = node("full");
        full.claimed_memory_mib = (8 << 10) * MEMORY_OVERCOMMIT - 511;
        let mut busy = node("busy");
        busy.claimed_cpu_millis = 2 * 1000 * CPU_OVERCOMMIT;
        let mut gone = node("gone");
        gone.reachable = false;
        gone.pool_ready = 9;
        let mut vm = node("vm");
        vm.runtimes = vec![RuntimeKind::Microvm];
        let mut drained = node("drained");
        drained.draining = true;
        drained.pool_ready = 9;
        let e = place(
            &[
                full.clone(),
                busy.clone(),
                gone.clone(),
                vm.clone(),
                drained,
            ],
            &NEED,
            "s1",
        )
        .unwrap_err();
        for part in [
            "full: memory fully claimed",
            "busy: CPU fully claimed",
            "gone: unreachable",
            "vm: lacks the runtime",
            "drained: draining",
        ] {
            assert!(e.contains(part), "{e}");
        }
        // Exactly at capacity still fits.
        full.claimed_memory_mib -= 1;
        assert_eq!(
            place(&[full, busy, gone, vm], &NEED, "s1").unwrap().node,
            "full"
        );
        assert_eq!(place(&[], &NEED, "s1").unwrap_err(), "no node has joined");
    }

    #[test]
    fn placing_many_never_exceeds_any_node() {
        // Nodes of different sizes, filled one sandbox at a time as the claims grow.
        let mut nodes: Vec<Candidate> = (0..7)
            .map(|i| Candidate {
                cpus: 1 + i % 3,
                memory_bytes: (1 + u64::from(i % 4)) << 30,
                ..node(&format!("n{i}"))
            })
            .collect();
        let mut placed = 0;
        while let Ok(p) = place(&nodes, &NEED, &format!("s{placed}")) {
            let n = nodes.iter_mut().find(|n| n.id == p.node).unwrap();
            n.claimed_cpu_millis += NEED.cpu_millis;
            n.claimed_memory_mib += NEED.memory_mib;
            placed += 1;
            assert!(placed < 10_000);
        }
        for n in &nodes {
            assert!(n.claimed_memory_mib <= n.memory_capacity_mib(), "{n:?}");
            assert!(n.claimed_cpu_millis <= n.cpu_capacity(), "{n:?}");
        }
        // Every node was used up to what fits.
        assert!(nodes.iter().all(|n| n.refuses(&NEED).is_some()));
        assert!(placed > 40, "{placed}");
    }
}
