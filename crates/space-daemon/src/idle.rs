//! Gives the allocator's free memory back to the kernel once the daemon goes quiet (decision
//! 0063). A sandbox's daemon is idle most of its life, and a node holds thousands of them:
//! each should hold what it uses, not what its busiest moment used. An idle daemon never
//! wakes for this: the trim follows activity, it does not poll.

use std::time::Duration;

use tokio::sync::Notify;

/// How long nothing must happen before the trim.
pub const TRIM_AFTER: Duration = Duration::from_secs(2);

static ACTIVITY: Notify = Notify::const_new();

/// Something happened that allocates or frees memory: a call came in, a process ended or was
/// forgotten.
pub fn note_activity() {
    ACTIVITY.notify_one();
}

/// Forever: after each spell of activity, once nothing has happened for [`TRIM_AFTER`], hands
/// the allocator's free pages back.
pub async fn trim_when_idle() {
    loop {
        ACTIVITY.notified().await;
        while tokio::time::timeout(TRIM_AFTER, ACTIVITY.notified())
            .await
            .is_ok()
        {}
        space_sys::process::release_free_memory();
    }
}
