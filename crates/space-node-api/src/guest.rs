//! The channel a guest client speaks over: the sandbox's own gRPC channel on the node, or, for
//! a remote node, the node agent's channel with the sandbox named in a header. The node agent
//! forwards such requests unchanged (HTTP/2 streams, trailers and all) to the sandbox's channel
//! (decision 0032), so exec, attach, files and watch stream through it as they do in-process.
//!
//! Every call has a deadline (the daemon is untrusted: it may never answer, or stop halfway):
//! see [`deadline_of`]. Every message has a size limit: [`space_proto::MAX_MESSAGE_BYTES`].

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use space_proto::guest_client::GuestClient;
use tokio::time::{Instant, Sleep};
use tonic::body::Body;
use tonic::codegen::Service;
use tonic::codegen::http::{HeaderValue, Request, Response};
use tonic::transport::Channel;

use crate::NodeError;

/// The header that names the sandbox of a guest call forwarded through a node agent.
pub const SANDBOX_HEADER: &str = "space-sandbox";

/// A gRPC channel to one sandbox's daemon. Cheap to clone (tonic's `Channel` is a handle).
#[derive(Debug, Clone)]
pub struct GuestChannel {
    channel: Channel,
    /// Set when the channel is a node agent's: the sandbox to forward to.
    sandbox: Option<HeaderValue>,
}

impl GuestChannel {
    /// The sandbox's own channel.
    pub fn direct(channel: Channel) -> Self {
        Self {
            channel,
            sandbox: None,
        }
    }

    /// Sandbox `id`'s daemon through the node agent at the other end of `channel`.
    pub fn via_node(channel: Channel, id: &str) -> Result<Self, NodeError> {
        let sandbox = HeaderValue::from_str(id)
            .map_err(|_| NodeError::InvalidArgument(format!("bad sandbox id {id:?}")))?;
        Ok(Self {
            channel,
            sandbox: Some(sandbox),
        })
    }

    /// The node agent's end: the channel itself, to forward requests on.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// A client with the message limits both ends use.
    pub fn client(self) -> GuestClient<GuestChannel> {
        GuestClient::new(self)
            .max_decoding_message_size(space_proto::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(space_proto::MAX_MESSAGE_BYTES)
    }
}

/// How long a guest call may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deadline {
    /// The whole call: the answer's headers, its message and its trailers.
    Whole(Duration),
    /// A stream: its headers within the first, then never longer than the second between
    /// two messages (`None`: a stream may stay quiet as long as its process does).
    Stream(Duration, Option<Duration>),
}

/// Unary calls: a stat, a list, a signal. Long enough for a loaded machine, short enough that
/// a daemon that never answers frees the request.
pub const UNARY_DEADLINE: Duration = Duration::from_secs(30);
/// Calls whose work grows with the sandbox's files: `Sync`, `Remove`, `Rename`, `MakeDir`.
pub const FILESYSTEM_DEADLINE: Duration = Duration::from_secs(300);
/// A whole upload (`WriteFile`: its reply comes after the last chunk).
pub const UPLOAD_DEADLINE: Duration = Duration::from_secs(1800);
/// The most a file download may stay silent between two chunks.
pub const READ_IDLE: Duration = Duration::from_secs(60);

/// The deadline of the guest method at gRPC `path` (`/space.guest.v1.Guest/Stat`).
pub fn deadline_of(path: &str) -> Deadline {
    let method = path.rsplit('/').next().unwrap_or("");
    match method {
        "Exec" | "Attach" | "Watch" => Deadline::Stream(UNARY_DEADLINE, None),
        "ReadFile" => Deadline::Stream(UNARY_DEADLINE, Some(READ_IDLE)),
        "WriteFile" => Deadline::Whole(UPLOAD_DEADLINE),
        "Sync" | "Remove" | "Rename" | "MakeDir" => Deadline::Whole(FILESYSTEM_DEADLINE),
        _ => Deadline::Whole(UNARY_DEADLINE),
    }
}

/// A scale for every deadline (1 = as above); tests shrink it.
static DEADLINE_SCALE_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1000);

/// Scale every guest deadline by `per_mille`/1000 (tests make them short).
pub fn scale_deadlines(per_mille: u64) {
    DEADLINE_SCALE_MS.store(per_mille.max(1), std::sync::atomic::Ordering::Relaxed);
}

fn scaled(d: Duration) -> Duration {
    d * DEADLINE_SCALE_MS.load(std::sync::atomic::Ordering::Relaxed) as u32 / 1000
}

fn expired(method: &str, what: &str) -> tonic::codegen::StdError {
    Box::new(tonic::Status::deadline_exceeded(format!(
        "the sandbox's daemon did not {what} of {method} in time"
    )))
}

/// A response body under a deadline: the whole body by `until`, or each frame within `idle`
/// of the one before.
struct TimedBody {
    inner: Body,
    sleep: Pin<Box<Sleep>>,
    idle: Option<Duration>,
    method: String,
}

impl http_body::Body for TimedBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                if let Some(idle) = this.idle {
                    this.sleep.as_mut().reset(Instant::now() + idle);
                }
                Poll::Ready(frame)
            }
            Poll::Pending => match this.sleep.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    Poll::Ready(Some(Err(tonic::Status::deadline_exceeded(format!(
                        "the sandbox's daemon did not send the rest of {} in time",
                        this.method
                    )))))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

type CallFuture =
    Pin<Box<dyn Future<Output = Result<Response<Body>, tonic::codegen::StdError>> + Send>>;

impl Service<Request<Body>> for GuestChannel {
    type Response = Response<Body>;
    type Error = tonic::codegen::StdError;
    type Future = CallFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Service::poll_ready(&mut self.channel, cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        if let Some(id) = &self.sandbox {
            req.headers_mut().insert(SANDBOX_HEADER, id.clone());
        }
        let path = req.uri().path().to_owned();
        let method = path.rsplit('/').next().unwrap_or("").to_owned();
        let deadline = deadline_of(&path);
        let call = Service::call(&mut self.channel, req);
        Box::pin(async move {
            let start = Instant::now();
            let (headers_by, body_by, idle) = match deadline {
                Deadline::Whole(d) => (scaled(d), Some(scaled(d)), None),
                Deadline::Stream(h, idle) => (scaled(h), None, idle.map(scaled)),
            };
            let resp = match tokio::time::timeout(headers_by, call).await {
                Ok(r) => r?,
                Err(_) => return Err(expired(&method, "answer")),
            };
            let sleep = match (body_by, idle) {
                (Some(by), _) => start + by,
                (None, Some(idle)) => Instant::now() + idle,
                (None, None) => return Ok(resp),
            };
            Ok(resp.map(|inner| {
                Body::new(TimedBody {
                    inner,
                    sleep: Box::pin(tokio::time::sleep_until(sleep)),
                    idle,
                    method,
                })
            }))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;
    use tonic::codegen::http;

    /// A daemon that never answers `Stat`, and sends one chunk of `ReadFile` then nothing.
    #[derive(Clone)]
    struct Hostile;

    /// A body with one frame, then silence.
    struct OneThenSilence(bool);

    impl http_body::Body for OneThenSilence {
        type Data = bytes::Bytes;
        type Error = Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, Infallible>>> {
            if std::mem::replace(&mut self.0, true) {
                return Poll::Pending;
            }
            // One empty gRPC message: uncompressed, length 0.
            let frame = bytes::Bytes::from_static(&[0, 0, 0, 0, 0]);
            Poll::Ready(Some(Ok(http_body::Frame::data(frame))))
        }
    }

    impl Service<http::Request<Body>> for Hostile {
        type Response = http::Response<Body>;
        type Error = Infallible;
        type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, req: http::Request<Body>) -> Self::Future {
            let path = req.uri().path().to_owned();
            Box::pin(async move {
                if path.ends_with("/Stat") {
                    std::future::pending::<()>().await;
                }
                Ok(http::Response::builder()
                    .header("content-type", "application/grpc")
                    .body(Body::new(OneThenSilence(false)))
                    .unwrap())
            })
        }
    }

    impl tonic::server::NamedService for Hostile {
        const NAME: &'static str = "space.guest.v1.Guest";
    }

    #[test]
    fn deadlines_by_method() {
        assert_eq!(
            deadline_of("/space.guest.v1.Guest/Stat"),
            Deadline::Whole(UNARY_DEADLINE)
        );
        assert_eq!(
            deadline_of("/space.guest.v1.Guest/Exec"),
            Deadline::Stream(UNARY_DEADLINE, None)
        );
        assert_eq!(
            deadline_of("/space.guest.v1.Guest/ReadFile"),
            Deadline::Stream(UNARY_DEADLINE, Some(READ_IDLE))
        );
        assert_eq!(
            deadline_of("/space.guest.v1.Guest/WriteFile"),
            Deadline::Whole(UPLOAD_DEADLINE)
        );
        assert_eq!(
            deadline_of("/space.guest.v1.Guest/Sync"),
            Deadline::Whole(FILESYSTEM_DEADLINE)
        );
    }

    /// A daemon that never answers, or stops halfway through a download, frees the call at
    /// its deadline with DEADLINE_EXCEEDED (deadlines scaled to 1 % here: 0.3 s and 0.6 s).
    #[tokio::test]
    async fn a_silent_daemon_meets_the_deadline() {
        scale_deadlines(10);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(Hostile)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = GuestChannel::direct(channel).client();

        let t = std::time::Instant::now();
        let err = client
            .stat(space_proto::PathRequest { path: "/x".into() })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
        assert!(err.message().contains("Stat"), "{err:?}");
        let waited = t.elapsed();
        assert!(waited >= scaled(UNARY_DEADLINE), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");

        let t = std::time::Instant::now();
        let mut chunks = client
            .read_file(space_proto::ReadFileRequest {
                path: "/x".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(chunks.message().await.unwrap().is_some(), "the first chunk");
        let err = chunks.message().await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
        let waited = t.elapsed();
        assert!(waited >= scaled(READ_IDLE), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
    }
}
