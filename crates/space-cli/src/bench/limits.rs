//! Parameter limits: every bench subcommand checks its parameters here, before it creates
//! anything, and a refusal names the limit.

use anyhow::{Context, Result, bail};

/// Sandboxes one create run may make (`-n`).
pub const MAX_N: usize = 1000;
/// Repetitions of cheap operations (exec, reconnect).
pub const MAX_RUNS: usize = 10_000;
/// Repetitions of operations that create or copy (snapshots, peers).
pub const MAX_HEAVY_RUNS: usize = 1000;
/// QEMU boots and restores.
pub const MAX_QEMU_RUNS: usize = 100;
/// File throughput repetitions.
pub const MAX_FILE_RUNS: usize = 100;
/// Size of the file written and read back, in MiB.
pub const MAX_FILE_MIB: u64 = 1024;
/// Idle sandboxes of the density run.
pub const MAX_DENSITY: usize = 1000;
/// Seconds of sustained creates.
pub const MAX_DURATION_S: u64 = 60;
/// Concurrent create tasks.
pub const MAX_CONCURRENCY: usize = 64;
/// Ready sandboxes the throughput run asks the pool for.
pub const MAX_PREWARM: usize = 5000;
/// Pool pre-warm per second of throughput run (the 200 creates/s target, with headroom).
pub const PREWARM_PER_SECOND: usize = 250;
/// Most creates per second of throughput run the bench allows itself.
pub const MAX_CREATES_PER_SECOND: usize = 500;
/// What the bench budgets per sandbox when it sizes a run against the node's memory.
pub const SANDBOX_BUDGET_BYTES: u64 = 4 * 1024 * 1024;

/// Clients of the reconnect run at scale (issue 16 asks for 1,000).
pub const MAX_CLIENTS: usize = 5000;
/// Background processes per sandbox in that run.
pub const MAX_PER_SANDBOX: usize = 100;
/// Lines (`seq 1 N`) each process of that run prints: 100,000 is 588,895 bytes, within
/// the daemon's 1 MiB output ring, so nothing is dropped before a client reads it.
pub const MAX_LINES: u64 = 100_000;
/// Most reconnects per second of that run the bench allows itself (20x the goal).
pub const MAX_RECONNECTS_PER_SECOND: usize = 100_000;
/// Open files the bench keeps for itself beyond one per client.
pub const FILES_SPARE: u64 = 64;

/// Errors after which one task of a load benchmark (throughput, churn, reconnect) stops.
pub const MAX_TASK_ERRORS: usize = 20;

/// The top level of `space bench scale --live` (issue 16 asks for 10,000).
pub const MAX_LIVE: usize = 20_000;
/// What `space bench scale` budgets per idle sandbox (measured: 1.1 to 1.7 MiB of node
/// memory each, network slot included).
pub const SCALE_BUDGET_BYTES: u64 = 2 * 1024 * 1024;
/// Open files spaced holds per idle namespace sandbox (measured): the daemon's channel. The
/// slot's namespace is opened from its pin when needed, the node serves every slot's DNS and
/// proxy from its own sockets, and no pidfd is held on the init (decision 0059).
pub const FDS_PER_SANDBOX: u64 = 1;
/// Open files `space bench scale` leaves spaced beyond those: its slot pool, clients, logs.
pub const FDS_SPARE: u64 = 512;

const MIB: u64 = 1024 * 1024;

/// `flag` within `min..=max`, else an error naming the range.
pub fn check_range(flag: &str, v: u64, min: u64, max: u64) -> Result<()> {
    if v < min || v > max {
        bail!("{flag} must be between {min} and {max} (the limit), got {v}");
    }
    Ok(())
}

/// How many sandboxes fit in half of `mem_available` at [`SANDBOX_BUDGET_BYTES`] each.
pub fn sandbox_budget(mem_available: u64) -> usize {
    (mem_available / 2 / SANDBOX_BUDGET_BYTES) as usize
}

/// Refuses `count` sandboxes when `count` x 4 MiB exceeds half of MemAvailable.
pub fn check_sandbox_memory(flag: &str, count: usize, mem_available: u64) -> Result<()> {
    let budget = sandbox_budget(mem_available);
    if count > budget {
        bail!(
            "{flag} {count} needs about {} MiB ({} MiB per sandbox), more than half of this \
             node's MemAvailable ({} MiB): the limit here is {budget}",
            count as u64 * SANDBOX_BUDGET_BYTES / MIB,
            SANDBOX_BUDGET_BYTES / MIB,
            mem_available / MIB
        );
    }
    Ok(())
}

/// Refuses a buffer of `bytes` larger than half of MemAvailable.
pub fn check_buffer_memory(flag: &str, bytes: u64, mem_available: u64) -> Result<()> {
    if bytes > mem_available / 2 {
        bail!(
            "{flag} needs a {} MiB buffer, more than half of MemAvailable ({} MiB, the limit)",
            bytes / MIB,
            mem_available / MIB
        );
    }
    Ok(())
}

/// A field of /proc/meminfo, in bytes.
pub fn parse_meminfo(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        let mut it = rest.split_whitespace();
        let v: u64 = it.next()?.parse().ok()?;
        Some(match it.next() {
            Some("kB") => v * 1024,
            _ => v,
        })
    })
}

/// The node's MemAvailable and MemTotal, in bytes (the CLI runs on the node).
pub fn meminfo() -> Result<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/meminfo").context("cannot read /proc/meminfo")?;
    let avail = parse_meminfo(&text, "MemAvailable").context("no MemAvailable in /proc/meminfo")?;
    let total = parse_meminfo(&text, "MemTotal").context("no MemTotal in /proc/meminfo")?;
    Ok((avail, total))
}

pub fn mem_available() -> Result<u64> {
    Ok(meminfo()?.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_name_the_limit() {
        assert!(check_range("-n", 1, 1, 1000).is_ok());
        assert!(check_range("-n", 1000, 1, 1000).is_ok());
        let e = check_range("-n", 1001, 1, 1000).unwrap_err().to_string();
        assert!(
            e.contains("-n") && e.contains("1000") && e.contains("1001"),
            "{e}"
        );
        let e = check_range("--duration", 0, 1, 60).unwrap_err().to_string();
        assert!(e.contains("--duration must be between 1 and 60"), "{e}");
    }

    #[test]
    fn memory_budget_is_half_of_available_at_4_mib_each() {
        let avail = 8 * 1024 * MIB; // 8 GiB: 4 GiB / 4 MiB = 1024 sandboxes.
        assert_eq!(sandbox_budget(avail), 1024);
        assert!(check_sandbox_memory("--density", 1000, avail).is_ok());
        let e = check_sandbox_memory("--density", 1000, 6 * 1024 * MIB)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--density 1000") && e.contains("limit here is 768"),
            "{e}"
        );
        assert!(check_buffer_memory("--file-mib", 64 * MIB, 200 * MIB).is_ok());
        let e = check_buffer_memory("--file-mib", 64 * MIB, 100 * MIB)
            .unwrap_err()
            .to_string();
        assert!(e.contains("half of MemAvailable"), "{e}");
    }

    #[test]
    fn parses_meminfo() {
        let t = "MemTotal:       24683652 kB\nMemFree:        19633708 kB\n\
                 MemAvailable:   24025904 kB\nHugePages_Total:       0\n";
        assert_eq!(parse_meminfo(t, "MemTotal"), Some(24683652 * 1024));
        assert_eq!(parse_meminfo(t, "MemAvailable"), Some(24025904 * 1024));
        assert_eq!(parse_meminfo(t, "HugePages_Total"), Some(0));
        assert_eq!(parse_meminfo(t, "Mem"), None);
        assert_eq!(parse_meminfo(t, "SwapTotal"), None);
        // The real file parses.
        let (avail, total) = meminfo().unwrap();
        assert!(avail > 0 && total >= avail);
    }
}
