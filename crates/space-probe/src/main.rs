//! space-probe: run inside a sandbox by the tests. Tries to break isolation and prints one JSON
//! object: `{"<check>": {"ok": bool, "detail": "..."}, ...}` where `ok: true` means the
//! isolation HELD. Exit status 0 if every check held, 1 otherwise, 2 on bad usage.
//!
//! usage: space-probe [--host-marker PATH]... [--host-hostname NAME] [--expect-hostname NAME]
//!        space-probe net SUBCOMMAND ...   (network checks, see net.rs)
//!
//! Every attempt is harmless if it unexpectedly succeeds (see space_sys::process probes).
//! The checks that can change the probe's own state (setns, unshare) run last.

use std::collections::BTreeMap;
use std::io;
use std::path::Path;
use std::process::ExitCode;

use serde::Serialize;

mod net;

#[derive(Serialize)]
struct Check {
    ok: bool,
    detail: String,
}

#[derive(Default)]
struct Args {
    host_markers: Vec<String>,
    host_hostname: Option<String>,
    expect_hostname: Option<String>,
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
            _ => return Err(format!("unknown argument {a:?}")),
        }
    }
    Ok(args)
}

/// Denied: the kernel (or seccomp) refused for lack of privilege, or the call does not exist.
fn denied(r: &io::Result<()>) -> Check {
    match r {
        Ok(()) => Check {
            ok: false,
            detail: "the call succeeded".into(),
        },
        Err(e) => {
            let errno = e.raw_os_error().unwrap_or(0);
            let ok = matches!(errno, libc::EPERM | libc::EACCES | libc::ENOSYS);
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

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.first().map(String::as_str) == Some("net") {
        return net::main(&argv[1..]);
    }
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("space-probe: {e}");
            return ExitCode::from(2);
        }
    };
    use space_sys::process as p;
    let mut report: BTreeMap<&str, Check> = BTreeMap::new();
    report.insert("pid1_is_daemon", pid1_is_daemon());
    report.insert("host_processes_invisible", host_processes_invisible());
    report.insert("mount_denied", mount_denied());
    report.insert("umount_denied", umount_denied());
    report.insert("module_load_denied", module_load_denied());
    report.insert("bpf_denied", denied(&p::probe_bpf()));
    report.insert(
        "perf_event_open_denied",
        denied(&p::probe_perf_event_open()),
    );
    report.insert("keyctl_denied", denied(&p::probe_keyctl()));
    report.insert("ptrace_pid1_denied", denied(&p::probe_ptrace_seize(1)));
    report.insert("uid_map", uid_map());
    report.insert("caps", caps("CapEff:"));
    report.insert("bounding_set", caps("CapBnd:"));
    report.insert("seccomp", status_equals("Seccomp:", "2"));
    report.insert("hostname", hostname(&args));
    report.insert("proc_1_mem_denied", proc_1_mem_denied());
    report.insert("reboot_denied", denied(&p::probe_reboot()));
    report.insert("kexec_denied", denied(&p::probe_kexec_load()));
    report.insert("host_root_invisible", host_root_invisible(&args));
    report.insert("iopl_denied", denied(&p::probe_iopl()));
    report.insert("clock_settime_denied", denied(&p::probe_clock_settime()));
    // Last: these change the probe's own namespaces if they succeed.
    report.insert("setns_denied", setns_denied());
    report.insert("unshare_userns_denied", denied(&p::probe_unshare_userns()));

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
