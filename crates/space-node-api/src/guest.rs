//! The channel a guest client speaks over: the sandbox's own gRPC channel on the node, or, for
//! a remote node, the node agent's channel with the sandbox named in a header. The node agent
//! forwards such requests unchanged (HTTP/2 streams, trailers and all) to the sandbox's channel
//! (decision 0032), so exec, attach, files and watch stream through it as they do in-process.

use std::task::{Context, Poll};

use space_proto::guest_client::GuestClient;
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

impl Service<Request<Body>> for GuestChannel {
    type Response = Response<Body>;
    type Error = tonic::transport::Error;
    type Future = <Channel as Service<Request<Body>>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Service::poll_ready(&mut self.channel, cx)
    }

    fn call(&mut self, mut req: Request<Body>) -> Self::Future {
        if let Some(id) = &self.sandbox {
            req.headers_mut().insert(SANDBOX_HEADER, id.clone());
        }
        Service::call(&mut self.channel, req)
    }
}
