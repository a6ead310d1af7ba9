//! Idle daemon connections (decision 0064): a namespace sandbox's connection that no call has
//! used for `NodeConfig::guest_idle` is closed, and the next call connects again. An open
//! HTTP/2 connection keeps buffers at both ends (about 45 KiB together) and a file descriptor
//! in spaced, for every idle sandbox on the node. A microvm's channel is left open: its guest
//! keeps its disk's page cache, which a stop or snapshot must reach without a reconnect.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::Node;

impl Node {
    /// Starts the task that closes idle connections (none when `guest_idle` is zero).
    pub(super) fn start_idle_guest_closer(self: &Arc<Self>) {
        let idle = self.cfg.guest_idle;
        if !idle.is_zero() {
            tokio::spawn(closer_loop(Arc::downgrade(self), idle));
        }
    }

    /// Forgets the cached client of every namespace sandbox not handed out for `idle`; returns
    /// how many. A call in flight holds a clone of its own, so its connection closes only when
    /// the last such clone is gone.
    pub(super) fn close_idle_guests(&self, idle: Duration) -> usize {
        let now = Instant::now();
        let closed: Vec<_> = {
            let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
            table
                .values_mut()
                .filter(|e| {
                    e.client.is_some()
                        && now.duration_since(e.used) >= idle
                        && !self.disk(&e.record).in_guest()
                })
                .filter_map(|e| e.client.take())
                .collect()
        };
        // Dropped outside the table's lock.
        closed.len()
    }
}

async fn closer_loop(weak: Weak<Node>, idle: Duration) {
    let mut tick = tokio::time::interval((idle / 3).max(Duration::from_millis(20)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(node) = weak.upgrade() else {
            return;
        };
        let closed = node.close_idle_guests(idle);
        if closed > 0 {
            tracing::debug!(closed, "closed idle guest connections");
        }
    }
}
