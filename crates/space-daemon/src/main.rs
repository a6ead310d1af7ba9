//! space-daemon binary. Two modes:
//! - PID 1 of a sandbox: the channel is an inherited, listening unix socket whose fd number is
//!   in `SPACE_CHANNEL_FD` (3 in the namespace runtime).
//! - dev/test: `space-daemon --listen /path/to.sock` binds the socket itself.
//! - init of a microvm (`SPACE_GUEST=vm`, PID 1): sets the machine up (`guest_init`), then
//!   serves the virtio-serial port `space.0` (`vport`), one host connection at a time.

use std::os::unix::net::UnixListener as StdUnixListener;
use std::process::ExitCode;

use space_daemon::Config;

const USAGE: &str = "usage: space-daemon [--listen SOCKET]\n\
    Serves the space guest channel. Without --listen, the listening socket is the fd in\n\
    SPACE_CHANNEL_FD. Env: SPACE_LOG (error|warn|info|debug|trace), SPACE_OUTPUT_BUFFER_BYTES,\n\
    SPACE_EXITED_RETENTION_SECS, SPACE_DNS (resolver to write into /etc/resolv.conf),\n\
    SPACE_CA_PEM (CA to install under /etc/space).";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let listen = match args.as_slice() {
        [] => None,
        [flag, path] if flag == "--listen" => Some(path.clone()),
        [flag] if flag == "--version" => {
            println!("space-daemon {}", space_proto::PROTOCOL_VERSION);
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let level = std::env::var("SPACE_LOG")
        .ok()
        .and_then(|l| l.parse::<tracing::Level>().ok())
        .unwrap_or(tracing::Level::INFO);
    tracing_subscriber::fmt()
        .compact()
        .with_target(false)
        .with_max_level(level)
        .with_writer(space_daemon::log::make_writer)
        .init();

    let vm = listen.is_none() && space_daemon::guest_init::is_vm_guest();
    if vm {
        return run_vm_guest();
    }

    if let Err(e) =
        rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
    {
        tracing::warn!(error = %e, "PR_SET_DUMPABLE failed");
    }
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o022));
    match space_sys::process::set_loopback_up() {
        Ok(true) => tracing::debug!("brought lo up"),
        Ok(false) => {}
        Err(e) => tracing::warn!(error = %e, "cannot bring lo up"),
    }

    if listen.is_none() {
        let dns = std::env::var("SPACE_DNS").ok();
        let ca = std::env::var("SPACE_CA_PEM").ok();
        if let Err(e) =
            space_daemon::netsetup::apply(std::path::Path::new("/"), dns.as_deref(), ca.as_deref())
        {
            tracing::warn!(error = %e, "cannot write the resolver and CA files");
        }
    }

    let listener = match &listen {
        Some(path) => {
            // Not PID 1: adopt orphans anyway so they are reaped like in a sandbox.
            if let Err(e) = rustix::process::set_child_subreaper(Some(rustix::process::getpid())) {
                tracing::warn!(error = %e, "PR_SET_CHILD_SUBREAPER failed");
            }
            let _ = std::fs::remove_file(path);
            StdUnixListener::bind(path).map_err(|e| format!("failed to bind {path}: {e}"))
        }
        None => channel_listener(),
    };
    let listener = match listener {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = listener.set_nonblocking(true) {
        tracing::error!(error = %e, "failed to make the channel non-blocking");
        return ExitCode::FAILURE;
    }

    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(8)
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "failed to start the runtime");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        let listener = tokio::net::UnixListener::from_std(listener)
            .map_err(|e| format!("failed to register the channel: {e}"))?;
        tracing::info!(pid = std::process::id(), "space-daemon serving");
        space_daemon::serve(Config::from_env(), listener)
            .await
            .map_err(|e| format!("serving failed: {e}"))
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// The init of a microvm: set up, then serve the port. Never exits: a fatal error powers
/// the machine off (an exiting PID 1 panics the kernel).
fn run_vm_guest() -> ExitCode {
    use space_daemon::{guest_init, vport};
    tracing::info!(
        kernel_uptime_s = guest_init::kernel_uptime().unwrap_or(-1.0),
        "space-daemon starting as the guest's init"
    );
    if let Err(e) = guest_init::setup() {
        guest_init::power_off(&format!("guest setup failed: {}", guest_init::chain(&e)));
    }
    rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o022));
    if let Err(e) = space_sys::process::set_loopback_up() {
        tracing::warn!(error = %e, "cannot bring lo up");
    }
    let port = match vport::open_channel(guest_init::DEVICE_WAIT) {
        Ok(p) => p,
        Err(e) => guest_init::power_off(&format!("no guest channel: {}", guest_init::chain(&e))),
    };
    let mut cfg = Config::from_env();
    cfg.vm_guest = true;
    cfg.base_env
        .set(guest_init::default_env(cfg.base_env.get().as_ref().clone()));
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(8)
        .build()
    {
        Ok(rt) => rt,
        Err(e) => guest_init::power_off(&format!("failed to start the runtime: {e}")),
    };
    let result = rt.block_on(async {
        tracing::info!(
            kernel_uptime_s = guest_init::kernel_uptime().unwrap_or(-1.0),
            "space-daemon serving on {}",
            vport::PORT_NAME
        );
        space_daemon::serve_incoming(cfg, vport::sessions(port)).await
    });
    let msg = match result {
        Ok(()) => "serving ended".to_owned(),
        Err(e) => format!("serving failed: {}", guest_init::chain(&e)),
    };
    guest_init::power_off(&msg)
}

/// The inherited listening socket named by `SPACE_CHANNEL_FD`.
fn channel_listener() -> Result<StdUnixListener, String> {
    let fd: i32 = std::env::var("SPACE_CHANNEL_FD")
        .map_err(|_| {
            "SPACE_CHANNEL_FD is not set (use --listen SOCKET outside a sandbox)".to_owned()
        })?
        .parse()
        .map_err(|_| "SPACE_CHANNEL_FD is not a number".to_owned())?;
    let fd = space_sys::process::take_inherited_fd(fd)
        .map_err(|e| format!("cannot take channel fd {fd}: {e}"))?;
    match rustix::net::sockopt::socket_acceptconn(&fd) {
        Ok(true) => Ok(StdUnixListener::from(fd)),
        Ok(false) => Err("channel fd is not a listening socket".to_owned()),
        Err(e) => Err(format!("channel fd is not a socket: {e}")),
    }
}
