//! The guest-channel protocol: one gRPC service (`space.guest.v1.Guest`) that space-daemon
//! serves on the single channel of each sandbox. Generated from `proto/guest.proto`.

#![allow(clippy::all, missing_docs)]

pub mod guest {
    tonic::include_proto!("space.guest.v1");
}

pub use guest::*;

/// The protocol version the daemon reports in `InfoReply.version`.
pub const PROTOCOL_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Largest single gRPC message either side accepts (file chunks are far smaller).
pub const MAX_MESSAGE_BYTES: usize = 8 * 1024 * 1024;

/// Size of the chunks files and output are streamed in.
pub const CHUNK_BYTES: usize = 256 * 1024;
