//! The node's run dir (sockets, network namespace mounts; lost on reboot): one per node agent.
//!
//! Two node agents on one host must not share it: the second would remove the first's live
//! sandbox dirs as stale. So the default is derived from the data dir ([`default_for`]), and
//! a node holds an exclusive lock on `<run dir>/node.lock` while it runs ([`RunDirLock`]); a
//! second one is refused with the holder's pid and data dir.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The data dir whose run dir is `/run/space` itself.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/space";
/// The run dir of [`DEFAULT_DATA_DIR`]; other data dirs get `/run/space-<hash>`.
pub const DEFAULT_RUN_DIR: &str = "/run/space";
const LOCK_FILE: &str = "node.lock";
/// How long a node waits for the lock when the node named in it is dead: a child it forked
/// (a sandbox init before its exec) holds the lock's open file until it execs or exits, so a
/// node restarted at once after a kill -9 may find it held for a moment.
const DEAD_HOLDER_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The run dir of a node whose data dir is `data_dir`: `/run/space` for `/var/lib/space`,
/// else `/run/space-` and 12 hex digits of the SHA-256 of the data dir's absolute path
/// (short, because sandbox sockets live under it and a socket path has 107 bytes at most).
pub fn default_for(data_dir: &Path) -> PathBuf {
    let abs = std::path::absolute(data_dir).unwrap_or_else(|_| data_dir.to_owned());
    if abs == Path::new(DEFAULT_DATA_DIR) {
        return PathBuf::from(DEFAULT_RUN_DIR);
    }
    let digest = Sha256::digest(abs.as_os_str().as_encoded_bytes());
    let hex: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
    PathBuf::from(format!("{DEFAULT_RUN_DIR}-{hex}"))
}

#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    #[error(
        "run dir {run_dir} is in use by another space node ({holder}); give each one its own --run-dir, or leave --run-dir out so that it follows --data-dir"
    )]
    Held { run_dir: PathBuf, holder: String },
    #[error("cannot lock the run dir {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The exclusive hold of a run dir, released when dropped (or when the process dies: it is
/// an `flock`, so a kill -9 leaves nothing to clean up).
#[derive(Debug)]
pub struct RunDirLock {
    _file: File,
}

impl RunDirLock {
    /// Creates `run_dir` if needed and locks it, writing this process's pid and `data_dir`
    /// into the lock file for the message a second node would get.
    pub fn acquire(run_dir: &Path, data_dir: &Path) -> Result<RunDirLock, RunDirError> {
        Self::acquire_within(run_dir, data_dir, DEAD_HOLDER_WAIT)
    }

    /// [`acquire`](Self::acquire), waiting at most `dead_wait` while the node named in the
    /// lock file is no longer alive.
    fn acquire_within(
        run_dir: &Path,
        data_dir: &Path,
        dead_wait: std::time::Duration,
    ) -> Result<RunDirLock, RunDirError> {
        let deadline = std::time::Instant::now() + dead_wait;
        loop {
            match Self::try_acquire(run_dir, data_dir) {
                Err(RunDirError::Held { holder, .. })
                    if holder_is_dead(&holder) && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                done => return done,
            }
        }
    }

    fn try_acquire(run_dir: &Path, data_dir: &Path) -> Result<RunDirLock, RunDirError> {
        let path = run_dir.join(LOCK_FILE);
        let io = |source| RunDirError::Io {
            path: path.clone(),
            source,
        };
        fs::create_dir_all(run_dir).map_err(io)?;
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(io)?;
        if let Err(e) =
            rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
        {
            if e != rustix::io::Errno::WOULDBLOCK {
                return Err(io(e.into()));
            }
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = match holder.trim() {
                "" => "pid unknown".to_owned(),
                h => h.to_owned(),
            };
            return Err(RunDirError::Held {
                run_dir: run_dir.to_owned(),
                holder,
            });
        }
        let me = format!(
            "pid {}, data dir {}\n",
            std::process::id(),
            data_dir.display()
        );
        file.set_len(0).map_err(io)?;
        file.rewind().map_err(io)?;
        file.write_all(me.as_bytes()).map_err(io)?;
        Ok(RunDirLock { _file: file })
    }
}

/// Whether the node named in a lock file's text (`pid N, data dir D`) is gone.
fn holder_is_dead(holder: &str) -> bool {
    let pid = holder
        .strip_prefix("pid ")
        .and_then(|r| r.split(',').next())
        .and_then(|n| n.parse::<i32>().ok())
        .and_then(rustix::process::Pid::from_raw);
    pid.is_some_and(|p| rustix::process::test_kill_process(p) == Err(rustix::io::Errno::SRCH))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn run_dirs_follow_data_dirs() {
        assert_eq!(
            default_for(Path::new("/var/lib/space")),
            Path::new("/run/space")
        );
        let a = default_for(Path::new("/srv/a"));
        let b = default_for(Path::new("/srv/b"));
        assert_ne!(a, b);
        assert_eq!(a, default_for(Path::new("/srv/a")));
        assert!(a.to_str().unwrap().starts_with("/run/space-"));
        assert_eq!(a.to_str().unwrap().len(), "/run/space-".len() + 12);
    }

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_name() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        let first = RunDirLock::acquire(&run, Path::new("/data/one")).unwrap();
        // flock locks belong to open file descriptions: a second open in this process
        // conflicts as another process's would.
        let err = RunDirLock::acquire(&run, Path::new("/data/two")).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("in use by another space node")
                && msg.contains(&format!("pid {}", std::process::id()))
                && msg.contains("/data/one"),
            "{msg}"
        );
        drop(first);
        RunDirLock::acquire(&run, Path::new("/data/two")).unwrap();
    }

    /// A lock still held after its node died (by a child of that node, here another open of
    /// the file) is waited for, not refused at once; one that stays held is refused.
    #[test]
    fn a_dead_nodes_lock_is_waited_for() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        let mut gone = std::process::Command::new("true").spawn().unwrap();
        let dead = gone.id();
        gone.wait().unwrap();
        let first = RunDirLock::acquire(&run, Path::new("/data/old")).unwrap();
        fs::write(
            run.join(LOCK_FILE),
            format!("pid {dead}, data dir /data/old\n"),
        )
        .unwrap();
        // Held for good: refused once the wait is over, naming the dead node.
        let err =
            RunDirLock::acquire_within(&run, Path::new("/data/new"), Duration::from_millis(200))
                .unwrap_err();
        assert!(err.to_string().contains(&format!("pid {dead}")), "{err}");
        // Let go of 300 ms later: taken.
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(first);
        });
        // (A live holder is refused at once: a_second_holder_is_refused_with_the_first_ones_name.)
        let t0 = std::time::Instant::now();
        RunDirLock::acquire(&run, Path::new("/data/new")).unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(250));
        t.join().unwrap();
        assert!(!holder_is_dead(&format!(
            "pid {}, data dir /d",
            std::process::id()
        )));
        assert!(!holder_is_dead("pid unknown"));
    }
}
