//! The node contract over the network (issue 14, decision 0032): `space.node.v1.Node`, a gRPC
//! service whose messages carry [`space_node_api`]'s types as JSON ([`wire`]).
//!
//! - [`server`]: the node agent serves it over any [`space_node_api::NodeApi`], and forwards
//!   guest calls (`space.guest.v1.Guest`, sandbox named in a header) to sandboxes' channels.
//! - [`client`]: [`RemoteNode`], the control plane's `NodeApi` for a node agent elsewhere.

pub mod client;
pub mod join;
pub mod server;
pub mod tls;
pub mod wire;

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

pub use client::RemoteNode;
pub use server::{NodeService, router};

/// A channel to the node agent at `url` (`http://HOST:PORT`). It connects at the first call
/// and again after a failure; HTTP/2 pings find a dead peer within about 30 s.
pub fn channel(url: &str) -> Result<Channel, String> {
    let endpoint = Endpoint::from_shared(url.to_owned())
        .map_err(|e| format!("bad node address {url:?}: {e}"))?;
    Ok(keepalive(endpoint).connect_lazy())
}

/// The connection settings of every channel between members.
fn keepalive(endpoint: Endpoint) -> Endpoint {
    endpoint
        .connect_timeout(Duration::from_secs(3))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(20))
        .keep_alive_while_idle(true)
}

#[cfg(test)]
mod tests;
