//! Daemon configuration, read once from the environment at startup.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

/// Default bytes of output kept per process.
pub const DEFAULT_OUTPUT_BUFFER_BYTES: usize = 1024 * 1024;
/// Default time an exited process stays listed and attachable.
pub const DEFAULT_EXITED_RETENTION: Duration = Duration::from_secs(600);

#[derive(Debug, Clone)]
pub struct Config {
    /// Output ring size per process (`SPACE_OUTPUT_BUFFER_BYTES`).
    pub output_buffer_bytes: usize,
    /// How long exited processes are kept (`SPACE_EXITED_RETENTION_SECS`).
    pub exited_retention: Duration,
    /// The base environment of every process started (the daemon's own, minus the channel fd).
    pub base_env: Vec<(OsString, OsString)>,
    /// Where `etc/passwd` and `etc/group` are read from ("/" inside a sandbox).
    pub root: PathBuf,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            output_buffer_bytes: DEFAULT_OUTPUT_BUFFER_BYTES,
            exited_retention: DEFAULT_EXITED_RETENTION,
            base_env: Vec::new(),
            root: PathBuf::from("/"),
        }
    }
}

impl Config {
    /// The configuration from the daemon's environment.
    pub fn from_env() -> Self {
        let num = |name: &str| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        Self {
            output_buffer_bytes: num("SPACE_OUTPUT_BUFFER_BYTES")
                .map_or(DEFAULT_OUTPUT_BUFFER_BYTES, |n| n as usize),
            exited_retention: num("SPACE_EXITED_RETENTION_SECS")
                .map_or(DEFAULT_EXITED_RETENTION, Duration::from_secs),
            base_env: std::env::vars_os()
                .filter(|(k, _)| !DAEMON_ONLY_ENV.iter().any(|d| k == d))
                .collect(),
            root: PathBuf::from("/"),
        }
    }
}

/// Variables meant for the daemon itself; the processes it starts never see them.
const DAEMON_ONLY_ENV: &[&str] = &[
    "SPACE_CHANNEL_FD",
    "SPACE_LOG",
    "SPACE_OUTPUT_BUFFER_BYTES",
    "SPACE_EXITED_RETENTION_SECS",
    "SPACE_DNS",
    "SPACE_CA_PEM",
];
