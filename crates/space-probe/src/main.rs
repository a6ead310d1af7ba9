//! space-probe: run inside a sandbox by the tests. Tries to break isolation and prints one JSON
//! object: `{"<check>": {"ok": bool, "detail": "..."}, ...}` where `ok: true` means the
//! isolation HELD. Exit status 0 if every check held, 1 otherwise, 2 on bad usage.
//!
//! usage: space-probe [--host-marker PATH]... [--host-hostname NAME] [--expect-hostname NAME]
//!                    [--host-pid PID] [--host-abstract NAME]
//!        space-probe --list                (every check's name and class, as JSON)
//!        space-probe net SUBCOMMAND ...   (network checks, see net.rs)
//!
//! Each entry of the report also names its class (`syscall`, `ioctl`, `socket`, `mount`,
//! `capability`, `proc-sys`, `cgroup`, `device`, `rlimit`, `namespace`, `host`).
//!
//! Every attempt is harmless if it unexpectedly succeeds (see space_sys::process probes).
//! The checks that can change the probe's own state (setns, unshare) run last.

use std::collections::BTreeMap;
use std::io;
use std::path::Path;
use std::process::ExitCode;

use serde::Serialize;

mod escape;
mod net;

#[derive(Serialize)]
struct Check {
    ok: bool,
    detail: String,
}

impl Check {
    fn ok(detail: impl Into<String>) -> Check {
        Check {
            ok: true,
            detail: detail.into(),
        }
    }

    fn fail(detail: impl Into<String>) -> Check {
        Check {
            ok: false,
            detail: detail.into(),
        }
    }
}

/// A check's result in the report.
#[derive(Serialize)]
struct Entry {
    ok: bool,
    detail: String,
    class: &'static str,
}

#[derive(Default)]
struct Args {
    host_markers: Vec<String>,
    host_hostname: Option<String>,
    expect_hostname: Option<String>,
    host_pid: Option<i32>,
    host_abstract: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args::default();
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--host-marker" => args.host_markers.push(val()?),
            "--host-hostname" => args.host_hostname = Some(val()?),
            "--expect-hostname" => args.expect_hostname = Some(val()?),
            "--host-pid" => {
                let v = val()?;
                args.host_pid = Some(v.parse().map_err(|_| format!("bad --host-pid {v:?}"))?);
            }
            "--host-abstract" => args.host_abstract = Some(val()?),
            _ => return Err(format!("unknown argument {a:?}")),
        }
    }
    Ok(args)
}

/// Denied: the kernel (or seccomp) refused for lack of privilege, a read-only mount refused
/// the write, or the call does not exist.
fn denied(r: &io::Result<()>) -> Check {
    match r {
        Ok(()) => Check {
            ok: false,
            detail: "the call succeeded".into(),
        },
        Err(e) => {
            let errno = e.raw_os_error().unwrap_or(0);
            let ok = matches!(
                errno,
                libc::EPERM | libc::EACCES | libc::ENOSYS | libc::EROFS
            );
            Check {
                ok,
                detail: if ok {
                    format!("denied: {e}")
                } else {
                    format!("not denied by a permission check: {e}")
                },
            }
        }
    }
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn cmdline(pid: &str) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            String::from_utf8_lossy(&b)
                .replace('\0', " ")
                .trim()
                .to_owned()
        })
        .unwrap_or_default()
}

fn status_field(status: &str, key: &str) -> Option<String> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_owned()))
}

fn pid1_is_daemon() -> Check {
    let cmd = cmdline("1");
    Check {
        ok: cmd.contains("space-daemon"),
        detail: format!("/proc/1/cmdline: {cmd:?}"),
    }
}

fn host_processes_invisible() -> Check {
    let mut pids = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.parse::<u32>().is_ok() {
                pids.push(name);
            }
        }
    }
    let suspicious: Vec<String> = pids
        .iter()
        .map(|p| (p, cmdline(p)))
        .filter(|(_, c)| c.contains("spaced") || c.contains("systemd"))
        .map(|(p, c)| format!("{p}: {c}"))
        .collect();
    Check {
        ok: !pids.is_empty() && pids.len() <= 64 && suspicious.is_empty(),
        detail: format!("{} pids visible; host-like: {suspicious:?}", pids.len()),
    }
}

fn mount_denied() -> Check {
    let dir = std::env::temp_dir().join(format!("space-probe-mnt-{}", std::process::id()));
    let _ = std::fs::create_dir(&dir);
    let target = if dir.is_dir() {
        dir.as_path()
    } else {
        Path::new("/")
    };
    let r = rustix::mount::mount(
        "none",
        target,
        "tmpfs",
        rustix::mount::MountFlags::empty(),
        None,
    )
    .map_err(io::Error::from);
    if r.is_ok() {
        let _ = rustix::mount::unmount(target, rustix::mount::UnmountFlags::DETACH);
    }
    let _ = std::fs::remove_dir(&dir);
    denied(&r)
}

fn umount_denied() -> Check {
    // MNT_EXPIRE only marks the mount on a first call: harmless if it is allowed (EAGAIN).
    let r = rustix::mount::unmount("/proc", rustix::mount::UnmountFlags::EXPIRE)
        .map_err(io::Error::from);
    denied(&r)
}

fn module_load_denied() -> Check {
    let a = denied(&space_sys::process::probe_init_module());
    let b = denied(&space_sys::process::probe_finit_module());
    Check {
        ok: a.ok && b.ok,
        detail: format!("init_module: {}; finit_module: {}", a.detail, b.detail),
    }
}

fn uid_map() -> Check {
    let map = read("/proc/self/uid_map");
    let lines: Vec<Vec<u64>> = map
        .lines()
        .map(|l| {
            l.split_whitespace()
                .filter_map(|f| f.parse().ok())
                .collect()
        })
        .filter(|f: &Vec<u64>| f.len() == 3)
        .collect();
    let Some(first) = lines.first() else {
        return Check {
            ok: false,
            detail: format!("unreadable uid_map: {map:?}"),
        };
    };
    // No range may map onto host uid 0.
    let maps_host_root = lines.iter().any(|f| f[1] == 0);
    Check {
        ok: first[0] == 0 && first[1] != 0 && !maps_host_root,
        detail: format!(
            "base {} (inside {} -> host {}, count {}); {} range(s); host uid 0 mapped: {}",
            first[1],
            first[0],
            first[1],
            first[2],
            lines.len(),
            maps_host_root
        ),
    }
}

/// The capability set `field` of /proc/self/status (`CapEff:`, `CapBnd:`) holds none of the
/// capabilities that reach past a sandbox. The bounding set caps what any set-uid or
/// file-capability program can gain (sudo included).
fn caps(field: &str) -> Check {
    let status = read("/proc/self/status");
    let Some(eff) = status_field(&status, field) else {
        return Check {
            ok: false,
            detail: format!("no {field} in /proc/self/status"),
        };
    };
    let bits = u64::from_str_radix(&eff, 16).unwrap_or(u64::MAX);
    let dangerous = [
        (21, "CAP_SYS_ADMIN"),
        (19, "CAP_SYS_PTRACE"),
        (16, "CAP_SYS_MODULE"),
    ];
    let present: Vec<&str> = dangerous
        .iter()
        .filter(|(b, _)| bits & (1 << b) != 0)
        .map(|(_, n)| *n)
        .collect();
    Check {
        ok: present.is_empty(),
        detail: format!("{field} {eff}; dangerous present: {present:?}"),
    }
}

fn status_equals(key: &str, want: &str) -> Check {
    let v = status_field(&read("/proc/self/status"), key);
    Check {
        ok: v.as_deref() == Some(want),
        detail: format!("{key} {}", v.unwrap_or_else(|| "missing".into())),
    }
}

fn hostname(args: &Args) -> Check {
    let uts = rustix::system::uname();
    let name = uts.nodename().to_string_lossy().into_owned();
    let mut ok = true;
    let mut detail = format!("hostname {name:?}");
    if let Some(h) = &args.host_hostname {
        ok &= &name != h;
        detail.push_str(&format!("; host's {h:?}"));
    }
    if let Some(e) = &args.expect_hostname {
        ok &= &name == e;
        detail.push_str(&format!("; expected {e:?}"));
    }
    if args.host_hostname.is_none() && args.expect_hostname.is_none() {
        detail.push_str(" (no reference given)");
    }
    // Changing it must not be possible either (it would only change the sandbox's UTS
    // namespace, but a trimmed capability set refuses it).
    let set = rustix::system::sethostname(name.as_bytes()).map_err(io::Error::from);
    let set_check = denied(&set);
    Check {
        ok: ok && set_check.ok,
        detail: format!("{detail}; sethostname: {}", set_check.detail),
    }
}

fn proc_1_mem_denied() -> Check {
    let r = std::fs::File::open("/proc/1/mem").map(|_| ());
    denied(&r)
}

/// The daemon's stdout and stderr are a log file on the host (a namespace sandbox's
/// `daemon.log` in the node's run dir, on tmpfs): writing through them would fill the host.
fn proc_1_fds_denied() -> Check {
    let checks: Vec<Check> = ["/proc/1/fd/1", "/proc/1/fd/2"]
        .iter()
        .map(|p| {
            let r = std::fs::OpenOptions::new().append(true).open(p).map(|_| ());
            denied(&r)
        })
        .collect();
    Check {
        ok: checks.iter().all(|c| c.ok),
        detail: checks
            .iter()
            .map(|c| c.detail.as_str())
            .collect::<Vec<_>>()
            .join("; "),
    }
}

fn host_root_invisible(args: &Args) -> Check {
    if args.host_markers.is_empty() {
        return Check {
            ok: true,
            detail: "no --host-marker given".into(),
        };
    }
    let visible: Vec<&String> = args
        .host_markers
        .iter()
        .filter(|m| std::fs::symlink_metadata(m).is_ok())
        .collect();
    Check {
        ok: visible.is_empty(),
        detail: format!("markers {:?}; visible {visible:?}", args.host_markers),
    }
}

fn setns_denied() -> Check {
    let r = std::fs::File::open("/proc/1/ns/net").and_then(|f| {
        use std::os::fd::AsFd;
        rustix::thread::move_into_link_name_space(
            f.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .map_err(io::Error::from)
    });
    denied(&r)
}

/// The original checks, before the battery of escape.rs.
const FIRST: &[escape::Probe] = &[
    ("pid1_is_daemon", "namespace", |_| pid1_is_daemon()),
    ("host_processes_invisible", "namespace", |_| {
        host_processes_invisible()
    }),
    ("mount_denied", "mount", |_| mount_denied()),
    ("umount_denied", "mount", |_| umount_denied()),
    ("module_load_denied", "syscall", |_| module_load_denied()),
    ("bpf_denied", "syscall", |_| {
        denied(&space_sys::process::probe_bpf())
    }),
    ("perf_event_open_denied", "syscall", |_| {
        denied(&space_sys::process::probe_perf_event_open())
    }),
    ("keyctl_denied", "syscall", |_| {
        denied(&space_sys::process::probe_keyctl())
    }),
    ("ptrace_pid1_denied", "syscall", |_| {
        denied(&space_sys::process::probe_ptrace_seize(1))
    }),
    ("uid_map", "namespace", |_| uid_map()),
    ("caps", "capability", |_| caps("CapEff:")),
    ("bounding_set", "capability", |_| caps("CapBnd:")),
    ("seccomp", "syscall", |_| status_equals("Seccomp:", "2")),
    ("hostname", "namespace", hostname),
    ("proc_1_mem_denied", "proc-sys", |_| proc_1_mem_denied()),
    ("proc_1_fds_denied", "proc-sys", |_| proc_1_fds_denied()),
    ("reboot_denied", "syscall", |_| {
        denied(&space_sys::process::probe_reboot())
    }),
    ("kexec_denied", "syscall", |_| {
        denied(&space_sys::process::probe_kexec_load())
    }),
    ("host_root_invisible", "host", host_root_invisible),
    ("iopl_denied", "syscall", |_| {
        denied(&space_sys::process::probe_iopl())
    }),
    ("clock_settime_denied", "syscall", |_| {
        denied(&space_sys::process::probe_clock_settime())
    }),
];

/// Last: these change the probe's own namespaces if they succeed.
const LAST: &[escape::Probe] = &[
    ("setns_denied", "namespace", |_| setns_denied()),
    ("unshare_userns_denied", "namespace", |_| {
        denied(&space_sys::process::probe_unshare_userns())
    }),
    ("unshare_mountns_denied", "namespace", |_| {
        denied(&space_sys::probe::unshare(libc::CLONE_NEWNS))
    }),
    ("unshare_netns_denied", "namespace", |_| {
        denied(&space_sys::probe::unshare(libc::CLONE_NEWNET))
    }),
];

fn all_probes() -> impl Iterator<Item = &'static escape::Probe> {
    FIRST.iter().chain(escape::PROBES).chain(LAST)
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.first().map(String::as_str) == Some("net") {
        return net::main(&argv[1..]);
    }
    if argv.first().map(String::as_str) == Some("--list") {
        let list: Vec<serde_json::Value> = all_probes()
            .map(|(name, class, _)| serde_json::json!({"name": name, "class": class}))
            .collect();
        println!("{}", serde_json::Value::Array(list));
        return ExitCode::SUCCESS;
    }
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("space-probe: {e}");
            return ExitCode::from(2);
        }
    };
    let mut report: BTreeMap<&str, Entry> = BTreeMap::new();
    for (name, class, probe) in all_probes() {
        let c = probe(&args);
        report.insert(
            name,
            Entry {
                ok: c.ok,
                detail: c.detail,
                class,
            },
        );
    }

    let all_ok = report.values().all(|c| c.ok);
    match serde_json::to_string(&report) {
        Ok(json) => println!("{json}"),
        Err(e) => {
            eprintln!("space-probe: {e}");
            return ExitCode::from(2);
        }
    }
    if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
