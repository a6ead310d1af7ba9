//! envd's messages: prost types from `proto/e2b/*.proto`, with pbjson's proto3 JSON mapping
//! (camelCase names, base64 bytes, enum names, flattened oneofs).

#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod process {
    include!(concat!(env!("OUT_DIR"), "/process.rs"));
    include!(concat!(env!("OUT_DIR"), "/process.serde.rs"));
}

#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod filesystem {
    include!(concat!(env!("OUT_DIR"), "/filesystem.rs"));
    include!(concat!(env!("OUT_DIR"), "/filesystem.serde.rs"));
}
