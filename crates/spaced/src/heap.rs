//! spaced gives freed heap back (decision 0065). glibc keeps what a burst freed in each of its
//! arenas: after 10,000 sandboxes came and went, spaced held 720 MB of arenas with 81 MB in
//! use. Once a minute, when more than [`KEEP_FREE`] sits free, `malloc_trim` returns it; a
//! node at rest, with little freed, is left alone.

use std::time::{Duration, Instant};

/// How often the free heap is looked at.
const CHECK_EVERY: Duration = Duration::from_secs(60);
/// Free heap kept without a trim.
const KEEP_FREE: usize = 64 << 20;

/// Starts the once-a-minute check.
pub fn spawn_trim() {
    tokio::spawn(async {
        let mut tick = tokio::time::interval(CHECK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick is at once: nothing was freed yet.
        tick.tick().await;
        loop {
            tick.tick().await;
            // It takes each arena's lock in turn: off the async workers.
            let _ = tokio::task::spawn_blocking(trim_if_worth_it).await;
        }
    });
}

fn trim_if_worth_it() {
    let Some(free) = space_sys::process::free_heap_bytes() else {
        return;
    };
    if free < KEEP_FREE {
        return;
    }
    let before = rss_mib();
    let t = Instant::now();
    space_sys::process::release_free_memory();
    tracing::info!(
        free_mib = free >> 20,
        rss_before_mib = before,
        rss_after_mib = rss_mib(),
        took_ms = t.elapsed().as_millis() as u64,
        "gave freed heap back"
    );
}

/// This process's resident memory, MiB (0 if /proc cannot say).
fn rss_mib() -> u64 {
    space_sys::process::rss_bytes(std::process::id()).map_or(0, |b| b >> 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Free heap in the middle of an arena (every 50th block kept, so nothing is free at its
    /// top) goes back only through the trim.
    #[test]
    fn a_large_free_heap_in_the_middle_is_given_back() {
        let blocks: Vec<Vec<u8>> = (0..200_000).map(|i| vec![i as u8; 1000]).collect();
        let kept: Vec<Vec<u8>> = blocks
            .into_iter()
            .enumerate()
            .filter(|(i, _)| i % 50 == 0 || *i == 199_999)
            .map(|(_, b)| b)
            .collect();
        let free = space_sys::process::free_heap_bytes().unwrap();
        assert!(free > KEEP_FREE, "only {free} bytes free");
        let before = rss_mib();
        trim_if_worth_it();
        let after = rss_mib();
        assert!(
            after + 100 <= before,
            "RSS {before} MiB before the trim, {after} MiB after"
        );
        assert_eq!(kept.len(), 4_001);
    }
}
