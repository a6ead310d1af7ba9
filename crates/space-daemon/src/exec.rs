//! Turning an `ExecRequest` into a ready-to-spawn `Command`: argv and PATH lookup, the merged
//! environment, working directory, user, stdio (pipes or a pseudo-terminal).

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use rustix::pty::OpenptFlags;
use space_proto::ExecRequest;

use crate::config::Config;
use crate::users::{self, UserError, UserInfo};

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const DEFAULT_ROWS: u16 = 24;
const DEFAULT_COLS: u16 = 80;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("executable not found: {0}")]
    NotFound(String),
    #[error("permission denied: {0} is not executable")]
    NotExecutable(String),
    #[error("working directory not found: {0}")]
    CwdNotFound(String),
    #[error("working directory is not a directory: {0}")]
    CwdNotDir(String),
    #[error(transparent)]
    User(#[from] UserError),
    #[error("failed to open a pseudo-terminal")]
    Pty(#[source] io::Error),
    #[error("failed to start {program}")]
    Spawn {
        program: String,
        #[source]
        source: io::Error,
    },
}

/// A command ready to spawn, plus what the caller needs to wire it up afterwards.
pub struct Prepared {
    /// Holds the child's ends of the stdio (dropped right after spawn).
    pub cmd: Command,
    /// The pty master when `tty` (the child got the slave as fds 0/1/2).
    pub pty_master: Option<OwnedFd>,
    /// stdin is a pipe the caller writes (`stdin` or `stdin_data`).
    pub stdin_piped: bool,
    /// The resolved cwd and user name, for listings.
    pub cwd: String,
    pub user: String,
}

/// Build the command for `req` (does not spawn).
pub fn prepare(cfg: &Config, req: &ExecRequest) -> Result<Prepared, ExecError> {
    let Some(argv0) = req.argv.first() else {
        return Err(ExecError::Invalid("argv is empty".into()));
    };
    if argv0.is_empty() {
        return Err(ExecError::Invalid("argv[0] is empty".into()));
    }
    if req.argv.iter().any(|a| a.contains('\0')) {
        return Err(ExecError::Invalid("argv contains a NUL byte".into()));
    }
    let user_spec = cfg.base_env.user_or_default(&req.user);
    let user: Option<UserInfo> = if user_spec.is_empty() {
        None
    } else {
        Some(users::lookup(&cfg.root, &user_spec)?)
    };

    // Environment: base, then the user's identity, then the request.
    let mut env: BTreeMap<OsString, OsString> = cfg.base_env.get().iter().cloned().collect();
    if let Some(u) = &user {
        env.insert("HOME".into(), u.home.clone().into());
        env.insert("USER".into(), u.name.clone().into());
        env.insert("LOGNAME".into(), u.name.clone().into());
    }
    if req.tty && !env.contains_key(OsStr::new("TERM")) {
        env.insert("TERM".into(), "xterm-256color".into());
    }
    for (k, v) in &req.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(ExecError::Invalid(format!(
                "invalid environment variable name {k:?} (or NUL in its value)"
            )));
        }
        env.insert(k.into(), v.into());
    }

    let default_cwd = cfg
        .base_env
        .default_cwd()
        .map(PathBuf::from)
        .filter(|d| d.is_absolute() && d.is_dir());
    let cwd = if let Some(d) = default_cwd.filter(|_| req.cwd.is_empty()) {
        d
    } else if req.cwd.is_empty() {
        let home = match &user {
            Some(u) => Some(PathBuf::from(&u.home)),
            None => env.get(OsStr::new("HOME")).map(PathBuf::from),
        };
        match home {
            Some(h) if h.is_absolute() && h.is_dir() => h,
            _ => PathBuf::from("/"),
        }
    } else {
        let c = PathBuf::from(&req.cwd);
        if !c.is_absolute() || req.cwd.contains('\0') {
            return Err(ExecError::Invalid(format!(
                "cwd must be an absolute path: {:?}",
                req.cwd
            )));
        }
        match std::fs::metadata(&c) {
            Ok(m) if m.is_dir() => c,
            Ok(_) => return Err(ExecError::CwdNotDir(req.cwd.clone())),
            Err(_) => return Err(ExecError::CwdNotFound(req.cwd.clone())),
        }
    };

    let program = resolve_program(
        argv0,
        env.get(OsStr::new("PATH")).map(|p| p.as_os_str()),
        &cwd,
    )?;
    let mut cmd = Command::new(&program);
    cmd.arg0(argv0)
        .args(&req.argv[1..])
        .env_clear()
        .envs(&env)
        .current_dir(&cwd);

    let mut stdin_piped = false;
    let pty_master = if req.tty {
        let (master, slave) = open_pty(req.rows, req.cols).map_err(ExecError::Pty)?;
        let dup = |fd: &OwnedFd| fd.try_clone().map_err(ExecError::Pty);
        cmd.stdin(Stdio::from(dup(&slave)?))
            .stdout(Stdio::from(dup(&slave)?))
            .stderr(Stdio::from(slave));
        Some(master)
    } else {
        if req.stdin || !req.stdin_data.is_empty() {
            stdin_piped = true;
            cmd.stdin(Stdio::piped());
        } else {
            cmd.stdin(Stdio::null());
        }
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        None
    };
    // A new session: its own process group (Signal with `group` reaches the whole tree) and,
    // with a tty, that terminal as the controlling one. Credentials last: setsid needs none.
    space_sys::process::set_session(&mut cmd, req.tty);
    space_sys::process::raise_oom_score_adj(&mut cmd);
    if let Some(u) = &user {
        space_sys::process::set_credentials(&mut cmd, u.uid, u.gid, u.groups.clone());
    }
    Ok(Prepared {
        cmd,
        pty_master,
        stdin_piped,
        cwd: cwd.to_string_lossy().into_owned(),
        user: user.map_or_else(|| "root".to_owned(), |u| u.name),
    })
}

/// execvp-style lookup: names with a '/' are taken as they are (relative to `cwd`), others
/// are searched in `path_var`. A match that is not executable is remembered and reported as
/// permission denied when nothing better is found.
pub fn resolve_program(
    argv0: &str,
    path_var: Option<&OsStr>,
    cwd: &Path,
) -> Result<PathBuf, ExecError> {
    if argv0.contains('/') {
        let p = cwd.join(argv0);
        return match std::fs::metadata(&p) {
            Ok(_) => Ok(p),
            Err(_) => Err(ExecError::NotFound(argv0.to_owned())),
        };
    }
    let path_var = path_var.unwrap_or(OsStr::new(DEFAULT_PATH));
    let mut denied = false;
    for dir in path_var.as_bytes().split(|b| *b == b':') {
        let dir = if dir.is_empty() {
            Path::new(".")
        } else {
            Path::new(OsStr::from_bytes(dir))
        };
        let candidate = cwd.join(dir).join(argv0);
        if let Ok(m) = std::fs::metadata(&candidate)
            && m.is_file()
        {
            if m.permissions().mode() & 0o111 != 0 {
                return Ok(candidate);
            }
            denied = true;
        }
    }
    if denied {
        Err(ExecError::NotExecutable(argv0.to_owned()))
    } else {
        Err(ExecError::NotFound(argv0.to_owned()))
    }
}

/// Open a pseudo-terminal pair of the given size; the master is non-blocking.
fn open_pty(rows: u32, cols: u32) -> io::Result<(OwnedFd, OwnedFd)> {
    let master =
        rustix::pty::openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)?;
    rustix::pty::grantpt(&master)?;
    rustix::pty::unlockpt(&master)?;
    let slave = match rustix::pty::ioctl_tiocgptpeer(
        &master,
        OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC,
    ) {
        Ok(fd) => fd,
        Err(_) => {
            let name = rustix::pty::ptsname(&master, Vec::new())?;
            rustix::fs::open(
                name.as_c_str(),
                rustix::fs::OFlags::RDWR | rustix::fs::OFlags::NOCTTY | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )?
        }
    };
    set_winsize(&master, rows, cols)?;
    rustix::io::ioctl_fionbio(&master, true)?;
    Ok((master, slave))
}

/// Set a terminal's size (0 = the default 24x80).
pub fn set_winsize(fd: &OwnedFd, rows: u32, cols: u32) -> io::Result<()> {
    let clamp = |v: u32, d: u16| {
        if v == 0 {
            d
        } else {
            v.min(u16::MAX as u32) as u16
        }
    };
    rustix::termios::tcsetwinsize(
        fd,
        rustix::termios::Winsize {
            ws_row: clamp(rows, DEFAULT_ROWS),
            ws_col: clamp(cols, DEFAULT_COLS),
            ws_xpixel: 0,
            ws_ypixel: 0,
        },
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_lookup_finds_executables_and_reports_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        std::fs::write(bin.join("tool"), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(bin.join("tool"), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(bin.join("data"), "x").unwrap();
        std::fs::set_permissions(bin.join("data"), std::fs::Permissions::from_mode(0o644)).unwrap();
        let path = OsString::from(format!("/nonexistent:{}", bin.display()));
        assert_eq!(
            resolve_program("tool", Some(&path), Path::new("/")).unwrap(),
            bin.join("tool")
        );
        assert!(matches!(
            resolve_program("data", Some(&path), Path::new("/")),
            Err(ExecError::NotExecutable(_))
        ));
        assert!(matches!(
            resolve_program("nope", Some(&path), Path::new("/")),
            Err(ExecError::NotFound(_))
        ));
        // Names with a slash are relative to the cwd.
        assert_eq!(
            resolve_program("bin/tool", None, dir.path()).unwrap(),
            dir.path().join("bin/tool")
        );
        assert!(matches!(
            resolve_program("./missing", None, dir.path()),
            Err(ExecError::NotFound(_))
        ));
    }

    #[test]
    fn request_env_overrides_base_and_bad_input_is_rejected() {
        let cfg = Config {
            base_env: crate::config::BaseEnv::new(vec![
                ("A".into(), "base".into()),
                ("B".into(), "base".into()),
            ]),
            ..Config::default()
        };
        let req = ExecRequest {
            argv: vec!["/bin/true".into()],
            env: [("B".to_string(), "req".to_string())].into(),
            ..Default::default()
        };
        let p = prepare(&cfg, &req).unwrap();
        let envs: BTreeMap<_, _> = p
            .cmd
            .get_envs()
            .map(|(k, v)| (k.to_owned(), v.map(|v| v.to_owned())))
            .collect();
        assert_eq!(
            envs.get(OsStr::new("A")).unwrap().as_deref(),
            Some(OsStr::new("base"))
        );
        assert_eq!(
            envs.get(OsStr::new("B")).unwrap().as_deref(),
            Some(OsStr::new("req"))
        );
        let bad = ExecRequest {
            argv: vec!["/bin/true".into()],
            env: [("X=Y".to_string(), "v".to_string())].into(),
            ..Default::default()
        };
        assert!(matches!(prepare(&cfg, &bad), Err(ExecError::Invalid(_))));
        let cwd = ExecRequest {
            argv: vec!["/bin/true".into()],
            cwd: "relative".into(),
            ..Default::default()
        };
        assert!(matches!(prepare(&cfg, &cwd), Err(ExecError::Invalid(_))));
    }
}
