//! Daemon configuration, read once from the environment at startup.

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use space_proto::{DEFAULT_CWD_ENV, DEFAULT_USER_ENV};

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
    /// The base environment of every process started (the daemon's own, minus the
    /// daemon-only variables); replaced by `Personalize`.
    pub base_env: BaseEnv,
    /// Where `etc/passwd` and `etc/group` are read from ("/" inside a sandbox).
    pub root: PathBuf,
    /// The daemon is the init of a microvm (`SPACE_GUEST=vm`): root of its own kernel, so it
    /// sets the hostname `Personalize` asks for.
    pub vm_guest: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            output_buffer_bytes: DEFAULT_OUTPUT_BUFFER_BYTES,
            exited_retention: DEFAULT_EXITED_RETENTION,
            base_env: BaseEnv::default(),
            root: PathBuf::from("/"),
            vm_guest: false,
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
            base_env: BaseEnv::new(std::env::vars_os().collect()),
            root: PathBuf::from("/"),
            vm_guest: false,
        }
    }
}

/// The base environment, shared by every exec and replaceable as a whole; the user that
/// exec and file operations naming none run as (`SPACE_DEFAULT_USER`, a template default:
/// `user` in the Debian `base`; root when unset) and the working directory of an exec that
/// names none (`SPACE_DEFAULT_CWD`, an image's WorkingDir; the user's home when unset).
#[derive(Debug, Clone, Default)]
pub struct BaseEnv(Arc<RwLock<BaseState>>);

#[derive(Debug, Default)]
struct BaseState {
    vars: Arc<EnvVars>,
    user: Option<String>,
    cwd: Option<String>,
}

/// Environment variables in order.
pub type EnvVars = Vec<(OsString, OsString)>;

impl BaseEnv {
    /// `vars` minus the daemon-only variables.
    pub fn new(vars: EnvVars) -> Self {
        let env = BaseEnv::default();
        env.set(vars);
        env
    }

    /// The environment now (cheap: one reference count).
    pub fn get(&self) -> Arc<EnvVars> {
        self.0
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .vars
            .clone()
    }

    /// The working directory of execs that name none (`None`: the user's home).
    pub fn default_cwd(&self) -> Option<String> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).cwd.clone()
    }

    /// The user of requests that name none (`None`: root).
    pub fn default_user(&self) -> Option<String> {
        self.0
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .user
            .clone()
    }

    /// `user`, or the default user when it is empty ("" still means root when there is none).
    pub fn user_or_default(&self, user: &str) -> String {
        if user.is_empty() {
            self.default_user().unwrap_or_default()
        } else {
            user.to_owned()
        }
    }

    /// Replaces it (daemon-only variables are dropped).
    pub fn set(&self, vars: EnvVars) {
        let get = |name: &str| {
            vars.iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.to_string_lossy().into_owned())
                .filter(|u| !u.is_empty())
        };
        let (user, cwd) = (get(DEFAULT_USER_ENV), get(DEFAULT_CWD_ENV));
        let vars = vars
            .into_iter()
            .filter(|(k, _)| !DAEMON_ONLY_ENV.iter().any(|d| k == d))
            .collect();
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = BaseState {
            vars: Arc::new(vars),
            user,
            cwd,
        };
    }
}

/// Variables meant for the daemon itself; the processes it starts never see them.
const DAEMON_ONLY_ENV: &[&str] = &[
    DEFAULT_USER_ENV,
    DEFAULT_CWD_ENV,
    "SPACE_CHANNEL_FD",
    "SPACE_LOG",
    "SPACE_OUTPUT_BUFFER_BYTES",
    "SPACE_EXITED_RETENTION_SECS",
    "SPACE_DNS",
    "SPACE_CA_PEM",
    "SPACE_GUEST",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_env_is_replaced_whole_and_shared_by_clones() {
        let env = BaseEnv::new(vec![
            ("A".into(), "1".into()),
            ("SPACE_CHANNEL_FD".into(), "3".into()),
        ]);
        assert_eq!(*env.get(), vec![("A".into(), "1".into())]);
        let clone = env.clone();
        env.set(vec![
            ("B".into(), "2".into()),
            ("SPACE_CA_PEM".into(), "pem".into()),
        ]);
        // The old value is gone (replaced, not merged) and clones see the new one.
        assert_eq!(*clone.get(), vec![("B".into(), "2".into())]);
        assert_eq!(clone.default_user(), None);
        assert_eq!(clone.user_or_default(""), "");
        env.set(vec![("SPACE_DEFAULT_USER".into(), "user".into())]);
        assert!(clone.get().is_empty());
        assert_eq!(clone.user_or_default(""), "user");
        assert_eq!(clone.user_or_default("root"), "root");
    }
}
