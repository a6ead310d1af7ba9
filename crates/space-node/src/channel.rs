//! The host end of the guest channel: a tonic client over the sandbox's unix socket.

use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;
use hyper_util::rt::TokioIo;
use space_node_api::GuestChannel;
use space_proto::{InfoRequest, PersonalizeRequest};
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

/// Connects to a sandbox's guest channel and checks readiness (the first RPC, `Info`).
#[async_trait]
pub trait GuestConnector: Send + Sync + 'static {
    async fn connect(&self, socket: &Path) -> Result<GuestChannel, ChannelError>;

    /// Connects with `Personalize(req)` as the first RPC and readiness check (a microvm's:
    /// a guest restored from a checkpoint reseeds its RNG there, before anything, `Info`'s
    /// boot id included, draws from it). Default: `connect`, then `Personalize`.
    async fn connect_personalized(
        &self,
        socket: &Path,
        req: PersonalizeRequest,
    ) -> Result<GuestChannel, ChannelError> {
        let channel = self.connect(socket).await?;
        channel
            .clone()
            .client()
            .personalize(req)
            .await
            .map_err(|status| ChannelError::Personalize {
                path: socket.to_path_buf(),
                status,
            })?;
        Ok(channel)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("failed to connect to {path}: {source}")]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("Info on {path} failed: {status}")]
    Info {
        path: PathBuf,
        status: tonic::Status,
    },
    #[error("Personalize on {path} failed: {status}")]
    Personalize {
        path: PathBuf,
        status: tonic::Status,
    },
    #[error("no answer on {path} within {timeout:?}")]
    Timeout { path: PathBuf, timeout: Duration },
}

/// A client on `socket` without connecting yet (the first RPC connects).
pub fn lazy_client(socket: &Path) -> GuestChannel {
    let path = socket.to_path_buf();
    let channel = endpoint().connect_with_connector_lazy(tower::service_fn(move |_| {
        let path = path.clone();
        async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
    }));
    wrap(channel)
}

fn endpoint() -> Endpoint {
    Endpoint::from_static("http://guest")
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
}

fn wrap(channel: Channel) -> GuestChannel {
    GuestChannel::direct(channel)
}

/// The real connector: HTTP/2 over the unix socket, then one `Info` within `ready_timeout`,
/// or a microvm's `Personalize` within `first_contact_timeout`.
#[derive(Debug, Clone)]
pub struct UnixConnector {
    pub ready_timeout: Duration,
    /// A microvm's first RPC after boot or restore: its daemon may still be finishing its
    /// start, and under TCG, with other guests booting beside it, 5 s was seen to pass
    /// (a boot of 43 s, then a Personalize answered after more than 5 s).
    pub first_contact_timeout: Duration,
}

impl Default for UnixConnector {
    fn default() -> Self {
        Self {
            ready_timeout: Duration::from_secs(5),
            first_contact_timeout: Duration::from_secs(30),
        }
    }
}

impl UnixConnector {
    /// HTTP/2 over the socket, then `first` (`Info`, or `Personalize` with its request), all
    /// within `ready_timeout`.
    async fn connect_with(
        &self,
        socket: &Path,
        first: Option<PersonalizeRequest>,
    ) -> Result<GuestChannel, ChannelError> {
        let path = socket.to_path_buf();
        let personalize = first.is_some();
        let work = async {
            let p = path.clone();
            let channel =
                endpoint()
                    .connect_with_connector(tower::service_fn(move |_| {
                        let p = p.clone();
                        async move {
                            Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(p).await?))
                        }
                    }))
                    .await
                    .map_err(|source| ChannelError::Connect {
                        path: path.clone(),
                        source,
                    })?;
            let channel = wrap(channel);
            let mut client = channel.clone().client();
            match first {
                None => client
                    .info(InfoRequest {})
                    .await
                    .map(|_| ())
                    .map_err(|status| ChannelError::Info {
                        path: path.clone(),
                        status,
                    })?,
                Some(req) => client
                    .personalize(req)
                    .await
                    .map(|_| ())
                    .map_err(|status| ChannelError::Personalize {
                        path: path.clone(),
                        status,
                    })?,
            }
            Ok(channel)
        };
        let timeout = if personalize {
            self.first_contact_timeout
        } else {
            self.ready_timeout
        };
        match tokio::time::timeout(timeout, work).await {
            Ok(r) => r,
            Err(_) => Err(ChannelError::Timeout { path, timeout }),
        }
    }
}

#[async_trait]
impl GuestConnector for UnixConnector {
    async fn connect(&self, socket: &Path) -> Result<GuestChannel, ChannelError> {
        self.connect_with(socket, None).await
    }

    async fn connect_personalized(
        &self,
        socket: &Path,
        req: PersonalizeRequest,
    ) -> Result<GuestChannel, ChannelError> {
        self.connect_with(socket, Some(req)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn missing_socket_is_a_connect_error_naming_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("guest.sock");
        let err = UnixConnector::default().connect(&sock).await.unwrap_err();
        assert!(matches!(err, ChannelError::Connect { .. }), "{err}");
        assert!(err.to_string().contains("guest.sock"));
    }

    #[tokio::test]
    async fn silent_guest_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("guest.sock");
        // Accepts connections but never speaks HTTP/2.
        let listener = tokio::net::UnixListener::bind(&sock).unwrap();
        let _accept = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        let c = UnixConnector {
            ready_timeout: Duration::from_millis(200),
            first_contact_timeout: Duration::from_millis(600),
        };
        let t0 = std::time::Instant::now();
        let err = c.connect(&sock).await.unwrap_err();
        assert!(matches!(err, ChannelError::Timeout { .. }), "{err}");
        assert!(t0.elapsed() < Duration::from_millis(500));
        // A first contact (Personalize) is given its own, longer bound.
        let t0 = std::time::Instant::now();
        let err = c
            .connect_personalized(&sock, PersonalizeRequest::default())
            .await
            .unwrap_err();
        assert!(matches!(err, ChannelError::Timeout { .. }), "{err}");
        assert!(
            t0.elapsed() >= Duration::from_millis(600),
            "{:?}",
            t0.elapsed()
        );
        assert!(t0.elapsed() < Duration::from_secs(2));
    }
}
