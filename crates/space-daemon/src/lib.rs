//! space-daemon: the guest agent. PID 1 inside every sandbox; serves the `Guest` gRPC service
//! (space-proto) on its single channel: exec (pipes or PTY) with reconnectable output
//! buffers, stdin, signals, files, identity.

pub mod config;
pub mod exec;
pub mod files;
#[doc(hidden)]
pub mod fuzzing;
pub mod guest_init;
pub mod idle;
pub mod log;
pub mod netsetup;
pub mod output;
pub mod procs;
pub mod service;
pub mod users;
pub mod vport;
pub mod watch;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use space_proto::guest_server::GuestServer;
use tokio::net::UnixListener;

pub use config::Config;

/// Serve the guest channel on `listener` until the process ends. Registers the SIGCHLD
/// reaper before anything can be spawned. Must be called inside a tokio runtime.
pub async fn serve(cfg: Config, listener: UnixListener) -> Result<(), tonic::transport::Error> {
    serve_incoming(
        cfg,
        tokio_stream::wrappers::UnixListenerStream::new(listener),
    )
    .await
}

/// [`serve`] on any stream of connections (a microvm's port yields one session at a time:
/// [`vport::sessions`]). One service, hence one process table, for all of them.
pub async fn serve_incoming<I, IO, IE>(
    cfg: Config,
    incoming: I,
) -> Result<(), tonic::transport::Error>
where
    I: futures::Stream<Item = Result<IO, IE>>,
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + tonic::transport::server::Connected
        + Unpin
        + Send
        + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let started_unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let cfg = Arc::new(cfg);
    let procs = procs::Procs::new(cfg.clone());
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()) {
        Ok(sigchld) => {
            tokio::spawn(procs.clone().run_reaper(sigchld));
        }
        Err(e) => tracing::error!(error = %e, "cannot watch SIGCHLD; exits will not be seen"),
    }
    tokio::spawn(idle::trim_when_idle());
    let svc = GuestServer::new(service::GuestService::new(cfg, procs, started_unix_ms))
        .max_decoding_message_size(space_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(space_proto::MAX_MESSAGE_BYTES);
    // Every call counts as activity for the idle trim.
    let svc = tonic::service::interceptor::InterceptedService::new(svc, |req| {
        idle::note_activity();
        Ok(req)
    });
    // A closed connection frees its buffers: activity too.
    let incoming = futures::StreamExt::map(incoming, |conn| conn.map(idle::Noted));
    tonic::transport::Server::builder()
        .add_service(svc)
        .serve_with_incoming(incoming)
        .await
}
