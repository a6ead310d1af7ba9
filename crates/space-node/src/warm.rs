//! Warm pools (decision 0013): per template, sandboxes built ahead of time and handed out on
//! create after a personalization step. This module is the bookkeeping only (sizes, targets,
//! hits and misses, what the refill should do next); the node builds, hands out and destroys
//! the members (`node/pools.rs`). Generic over the member type so it is tested without a kernel.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The refill waits until no create has taken a member for this long, so that building new
/// members does not compete with a burst of creates for the CPU.
pub const QUIET: Duration = Duration::from_millis(50);
/// A raised target falls back halfway toward `min` after this long without a miss or
/// demand that holds it up.
pub const DECAY_AFTER: Duration = Duration::from_secs(30);
/// Time constant of a pool's arrival rate: takes are counted with weights that fall by e
/// every this long, so the rate follows a change of demand within a few seconds.
pub const RATE_WINDOW: Duration = Duration::from_secs(5);
/// Demand a pool holds ready: this long of its observed arrival rate (decision 0050). The
/// target rises to it on the takes themselves, hits included, so a pool grows with a rising
/// rate before it runs dry instead of after its first misses.
pub const LEAD: Duration = Duration::from_secs(2);
/// After a failed build the pool waits this long before trying again.
pub const BUILD_BACKOFF: Duration = Duration::from_secs(2);
/// Memory budgeted per ready sandbox when sizing pools against the node's RAM (the idle
/// footprint budget of a sandbox).
pub const BYTES_PER_MEMBER: u64 = 4 << 20;

/// One template's pool.
#[derive(Debug)]
struct Pool<M> {
    min: u32,
    max: u32,
    target: u32,
    warning: Option<String>,
    /// Oldest first: (template version it was built from, member).
    ready: VecDeque<(u32, M)>,
    starting: u32,
    hits: u64,
    misses: u64,
    /// When the target was last raised, or held up by demand (the decay's clock).
    last_miss: Option<Instant>,
    last_grow: Option<Instant>,
    backoff_until: Option<Instant>,
    /// Takes per second as of `rate_at` (an exponentially decaying count over
    /// [`RATE_WINDOW`]).
    rate: f64,
    rate_at: Option<Instant>,
}

impl<M> Pool<M> {
    /// Takes per second at `now`.
    fn arrival_rate(&self, now: Instant) -> f64 {
        self.rate_at.map_or(0.0, |t| {
            let age = now.saturating_duration_since(t).as_secs_f64();
            self.rate * (-age / RATE_WINDOW.as_secs_f64()).exp()
        })
    }

    /// Counts one take at `now`; raises the target to [`LEAD`] of the new rate (within
    /// max), and keeps a target that demand holds up from decaying.
    fn arrive(&mut self, now: Instant) {
        self.rate = self.arrival_rate(now) + 1.0 / RATE_WINDOW.as_secs_f64();
        self.rate_at = Some(now);
        let demand = (self.rate * LEAD.as_secs_f64())
            .ceil()
            .min(f64::from(self.max)) as u32;
        if demand >= self.target && demand > self.min {
            self.target = demand;
            self.last_miss = Some(now);
        }
    }
}

/// What a template's pool looks like now.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolView {
    pub template: String,
    pub min: u32,
    pub max: u32,
    pub target: u32,
    /// Takes per second, as the pool observes them (over [`RATE_WINDOW`]).
    pub arrivals_per_s: f64,
    pub ready: u32,
    pub starting: u32,
    pub hits: u64,
    pub misses: u64,
    pub warning: Option<String>,
}

/// The next piece of refill work.
#[derive(Debug)]
pub enum Job<M> {
    /// Build one member for this template (already counted as starting).
    Build(String),
    /// Destroy these members (surplus after a shrink, or built from an old template version).
    Retire(Vec<M>),
    /// Nothing to do until woken (or this long has passed).
    Wait(Duration),
}

#[derive(Debug)]
pub struct Pools<M> {
    pools: Mutex<BTreeMap<String, Pool<M>>>,
    last_take: Mutex<Option<Instant>>,
    /// Members found stale by a take, for the refill to destroy.
    doomed: Mutex<Vec<M>>,
}

impl<M> Default for Pools<M> {
    fn default() -> Self {
        Self {
            pools: Mutex::new(BTreeMap::new()),
            last_take: Mutex::new(None),
            doomed: Mutex::new(Vec::new()),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<M> Pools<M> {
    /// Sets a template's sizes (already clamped). `min = max = 0` removes the pool; its
    /// ready members are returned to be destroyed. A smaller pool sheds its surplus through
    /// [`Pools::next_job`].
    pub fn configure(&self, template: &str, min: u32, max: u32, warning: Option<String>) -> Vec<M> {
        let mut pools = lock(&self.pools);
        if max == 0 {
            return pools
                .remove(template)
                .map(|p| p.ready.into_iter().map(|(_, m)| m).collect())
                .unwrap_or_default();
        }
        let p = pools.entry(template.to_owned()).or_insert_with(|| Pool {
            min,
            max,
            target: min,
            warning: None,
            ready: VecDeque::new(),
            starting: 0,
            hits: 0,
            misses: 0,
            last_miss: None,
            last_grow: None,
            backoff_until: None,
            rate: 0.0,
            rate_at: None,
        });
        p.min = min;
        p.max = max;
        p.target = p.target.clamp(min, max);
        p.warning = warning;
        p.backoff_until = None;
        Vec::new()
    }

    /// The sum of `max` over every pool but `except`'s (for sharing the node's capacity).
    pub fn reserved_except(&self, except: &str) -> u64 {
        lock(&self.pools)
            .iter()
            .filter(|(t, _)| t.as_str() != except)
            .map(|(_, p)| u64::from(p.max))
            .sum()
    }

    /// Takes a ready member of `template` built from `version` for a create. Counts a hit,
    /// or a miss when the template has a pool but nothing ready (the target then grows toward
    /// `max`, at most once a second). Either way the take counts toward the pool's arrival
    /// rate, which sizes it too ([`LEAD`]). Members of other versions are left to the refill
    /// to destroy.
    pub fn take(&self, template: &str, version: u32, now: Instant) -> Option<M> {
        *lock(&self.last_take) = Some(now);
        let mut pools = lock(&self.pools);
        let p = pools.get_mut(template)?;
        p.arrive(now);
        let mut stale = Vec::new();
        let mut found = None;
        while let Some((v, m)) = p.ready.pop_front() {
            if v == version {
                found = Some(m);
                break;
            }
            stale.push(m);
        }
        if found.is_some() {
            p.hits += 1;
        } else {
            p.misses += 1;
            p.last_miss = Some(now);
            if p.last_grow
                .is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1))
            {
                p.target = p.target.saturating_mul(2).max(p.target + 1).min(p.max);
                p.last_grow = Some(now);
            }
        }
        if !stale.is_empty() {
            lock(&self.doomed).extend(stale);
        }
        found
    }

    /// What the refill should do now. Builds wait for a quiet moment after the last take;
    /// retiring does not.
    pub fn next_job(&self, now: Instant) -> Job<M> {
        let doomed = std::mem::take(&mut *lock(&self.doomed));
        if !doomed.is_empty() {
            return Job::Retire(doomed);
        }
        let mut pools = lock(&self.pools);
        // A raised target decays halfway toward min after a while without misses.
        for p in pools.values_mut() {
            if p.target > p.min
                && p.last_miss
                    .is_none_or(|t| now.duration_since(t) >= DECAY_AFTER)
            {
                p.target = p.min + (p.target - p.min) / 2;
                p.last_miss = Some(now);
            }
        }
        for p in pools.values_mut() {
            let surplus = p.ready.len().saturating_sub(p.target as usize);
            if surplus > 0 {
                return Job::Retire(p.ready.drain(..surplus).map(|(_, m)| m).collect());
            }
        }
        let since_take = lock(&self.last_take).map(|t| now.duration_since(t));
        if let Some(since) = since_take
            && since < QUIET
        {
            return Job::Wait(QUIET - since);
        }
        let mut wait = Duration::from_secs(1);
        for (template, p) in pools.iter_mut() {
            if (p.ready.len() as u32 + p.starting) >= p.target {
                continue;
            }
            match p.backoff_until {
                Some(t) if t > now => wait = wait.min(t - now),
                _ => {
                    p.starting += 1;
                    return Job::Build(template.clone());
                }
            }
        }
        Job::Wait(wait)
    }

    /// Ends a build started by [`Job::Build`]: a built member joins the pool, unless the pool
    /// is gone or full (then it comes back to be destroyed). A failed build backs the pool off.
    pub fn finish_build(&self, template: &str, built: Option<(u32, M)>, now: Instant) -> Option<M> {
        let mut pools = lock(&self.pools);
        let Some(p) = pools.get_mut(template) else {
            return built.map(|(_, m)| m);
        };
        p.starting = p.starting.saturating_sub(1);
        match built {
            None => {
                p.backoff_until = Some(now + BUILD_BACKOFF);
                None
            }
            Some((v, m)) if (p.ready.len() as u32) < p.target => {
                p.backoff_until = None;
                p.ready.push_back((v, m));
                None
            }
            Some((_, m)) => Some(m),
        }
    }

    /// Removes the members of `template` built from versions other than `version` (after a
    /// template import).
    pub fn retire_other_versions(&self, template: &str, version: u32) -> Vec<M> {
        let mut pools = lock(&self.pools);
        let Some(p) = pools.get_mut(template) else {
            return Vec::new();
        };
        let (keep, old): (VecDeque<_>, VecDeque<_>) =
            p.ready.drain(..).partition(|(v, _)| *v == version);
        p.ready = keep;
        old.into_iter().map(|(_, m)| m).collect()
    }

    /// Removes every ready member (shutdown). The sizes stay.
    pub fn drain(&self) -> Vec<M> {
        lock(&self.pools)
            .values_mut()
            .flat_map(|p| p.ready.drain(..).map(|(_, m)| m).collect::<Vec<_>>())
            .collect()
    }

    pub fn view(&self, template: &str) -> Option<PoolView> {
        let now = Instant::now();
        lock(&self.pools)
            .get(template)
            .map(|p| view(template, p, now))
    }

    pub fn views(&self) -> Vec<PoolView> {
        let now = Instant::now();
        lock(&self.pools)
            .iter()
            .map(|(t, p)| view(t, p, now))
            .collect()
    }
}

fn view<M>(template: &str, p: &Pool<M>, now: Instant) -> PoolView {
    PoolView {
        template: template.to_owned(),
        min: p.min,
        max: p.max,
        target: p.target,
        arrivals_per_s: p.arrival_rate(now),
        ready: p.ready.len() as u32,
        starting: p.starting,
        hits: p.hits,
        misses: p.misses,
        warning: p.warning.clone(),
    }
}

/// Clamps requested sizes to `capacity` (what this pool may use of the node). Returns the
/// sizes in force and, when clamped, a warning naming the limit and where it comes from.
pub fn clamp(min: u32, max: u32, capacity: u64, why: &str) -> (u32, u32, Option<String>) {
    let cap = u32::try_from(capacity).unwrap_or(u32::MAX);
    if max <= cap {
        return (min, max, None);
    }
    let warning = format!(
        "requested pool sizes min {min}, max {max} exceed the node's capacity for ready \
         sandboxes of this pool ({cap}: {why}); clamped to min {}, max {cap}",
        min.min(cap)
    );
    (min.min(cap), cap, Some(warning))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t0() -> Instant {
        Instant::now()
    }

    impl<M> Pools<M> {
        fn lock_pool<T>(&self, template: &str, f: impl FnOnce(&Pool<M>) -> T) -> T {
            f(&lock(&self.pools)[template])
        }
    }

    /// Runs builds until the pool asks for none (each build succeeds with `version`).
    fn fill(p: &Pools<u32>, version: u32, now: Instant) -> u32 {
        let mut built = 0;
        loop {
            match p.next_job(now) {
                Job::Build(t) => {
                    built += 1;
                    assert!(p.finish_build(&t, Some((version, built)), now).is_none());
                }
                Job::Retire(_) => panic!("nothing to retire"),
                Job::Wait(_) => return built,
            }
        }
    }

    #[test]
    fn fills_to_min_and_hands_out_members_once() {
        let p = Pools::default();
        let now = t0();
        p.configure("base", 3, 8, None);
        assert_eq!(fill(&p, 1, now), 3);
        let v = p.view("base").unwrap();
        assert_eq!((v.ready, v.target, v.starting), (3, 3, 0));
        let later = now + Duration::from_secs(1);
        let a = p.take("base", 1, later);
        let b = p.take("base", 1, later);
        assert_ne!(a, b, "a member is handed out once");
        assert_eq!(p.view("base").unwrap().hits, 2);
        // Right after a take the refill waits for a quiet moment.
        assert!(matches!(p.next_job(later), Job::Wait(d) if d <= QUIET));
        assert_eq!(fill(&p, 1, later + QUIET), 2);
    }

    #[test]
    fn misses_grow_the_target_up_to_max_and_it_decays_back() {
        let p: Pools<u32> = Pools::default();
        let now = t0();
        p.configure("base", 2, 5, None);
        assert!(p.take("base", 1, now).is_none());
        assert_eq!(p.view("base").unwrap().target, 4);
        // At most one growth a second.
        p.take("base", 1, now);
        assert_eq!(p.view("base").unwrap().target, 4);
        p.take("base", 1, now + Duration::from_secs(1));
        let v = p.view("base").unwrap();
        assert_eq!((v.target, v.misses, v.hits), (5, 3, 0));
        // No miss for DECAY_AFTER: halfway back toward min, then again.
        let quiet = now + Duration::from_secs(1) + DECAY_AFTER;
        p.next_job(quiet);
        assert_eq!(p.view("base").unwrap().target, 3);
        p.next_job(quiet + DECAY_AFTER);
        assert_eq!(p.view("base").unwrap().target, 2);
    }

    #[test]
    fn the_arrival_rate_raises_the_target_while_every_take_is_a_hit() {
        for max in [100, 10] {
            let p = Pools::default();
            let now = t0();
            p.configure("base", 2, max, None);
            fill(&p, 1, now);
            // 20 takes a second for 3 s, each one served and refilled before the next.
            let mut t = now;
            for i in 0..60 {
                t = now + Duration::from_millis(50 * i);
                assert!(p.take("base", 1, t).is_some(), "take {i} missed");
                fill(&p, 1, t + QUIET);
            }
            let v = p.view("base").unwrap();
            assert_eq!((v.hits, v.misses), (60, 0));
            // 20/s seen through a 5 s window for 3 s: about 20 * (1 - e^-0.6) = 9.1/s.
            let rate = p.lock_pool("base", |p| p.arrival_rate(t));
            assert!((8.5..9.5).contains(&rate), "{rate}");
            let want = if max == 100 { 19 } else { 10 };
            assert_eq!(v.target, want, "LEAD of the rate, within max");
            assert_eq!(v.ready, want, "the refill built up to it");
            // Demand gone: the rate fades, and the target decays toward min as before.
            let idle = t + DECAY_AFTER;
            assert!(p.lock_pool("base", |p| p.arrival_rate(idle)) < 0.1);
            p.next_job(idle);
            assert_eq!(p.view("base").unwrap().target, 2 + (want - 2) / 2);
        }
    }

    #[test]
    fn shrinking_retires_the_surplus_and_zero_removes_the_pool() {
        let p = Pools::default();
        let now = t0();
        p.configure("base", 4, 4, None);
        fill(&p, 1, now);
        p.configure("base", 1, 1, None);
        match p.next_job(now) {
            Job::Retire(m) => assert_eq!(m.len(), 3),
            j => panic!("expected retire, got {j:?}"),
        }
        assert_eq!(p.view("base").unwrap().ready, 1);
        assert_eq!(p.configure("base", 0, 0, None).len(), 1);
        assert!(p.view("base").is_none());
        // A take for a template without a pool is neither a hit nor a miss.
        assert!(p.take("base", 1, now).is_none());
        assert!(p.views().is_empty());
    }

    #[test]
    fn members_of_an_old_template_version_are_never_handed_out() {
        let p = Pools::default();
        let now = t0();
        p.configure("base", 2, 2, None);
        fill(&p, 1, now);
        assert!(p.take("base", 2, now).is_none());
        match p.next_job(now) {
            Job::Retire(stale) => assert_eq!(stale, vec![1, 2]),
            j => panic!("expected the stale members, got {j:?}"),
        }
        fill(&p, 2, now + QUIET);
        assert_eq!(p.retire_other_versions("base", 3).len(), 2);
    }

    #[test]
    fn a_failed_build_backs_off_and_a_late_build_is_returned() {
        let p = Pools::default();
        let now = t0();
        p.configure("base", 1, 1, None);
        let Job::Build(t) = p.next_job(now) else {
            panic!("expected a build")
        };
        assert!(p.finish_build(&t, None, now).is_none());
        assert!(matches!(p.next_job(now), Job::Wait(d) if d <= BUILD_BACKOFF));
        let Job::Build(t) = p.next_job(now + BUILD_BACKOFF) else {
            panic!("expected a build after the backoff")
        };
        // The pool was turned off while the build ran: the member comes back.
        p.configure("base", 0, 0, None);
        assert_eq!(p.finish_build(&t, Some((1, 7)), now), Some(7));
    }

    #[test]
    fn clamping_names_the_limit() {
        assert_eq!(clamp(2, 10, 100, "x"), (2, 10, None));
        let (min, max, w) = clamp(50, 5000, 3000, "memory");
        assert_eq!((min, max), (50, 3000));
        let w = w.unwrap();
        assert!(
            w.contains("3000") && w.contains("memory") && w.contains("5000"),
            "{w}"
        );
        assert_eq!(clamp(4000, 5000, 3000, "m").0, 3000);
    }

    #[test]
    fn capacity_is_shared_between_pools() {
        let p: Pools<u32> = Pools::default();
        p.configure("a", 1, 10, None);
        p.configure("b", 1, 20, None);
        assert_eq!(p.reserved_except("a"), 20);
        assert_eq!(p.reserved_except("c"), 30);
    }
}
