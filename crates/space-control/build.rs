//! Compiles the E2B envd protocol (proto/e2b/*.proto) with protox (pure Rust; no system
//! protoc), prost for the messages and pbjson for their proto3 JSON mapping, which is the
//! codec E2B's SDKs speak (decision 0022).

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PROTOS: &[&str] = &["proto/e2b/process.proto", "proto/e2b/filesystem.proto"];
    for p in PROTOS {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(PROTOS, ["proto/e2b"])?;
    let descriptors = fds.encode_to_vec();
    prost_build::Config::new()
        // Timestamps with their JSON mapping (RFC 3339 strings).
        .extern_path(".google.protobuf.Timestamp", "::pbjson_types::Timestamp")
        .compile_fds(fds)?;
    pbjson_build::Builder::new()
        .register_descriptors(&descriptors)?
        // Like envd (connect-go): a newer SDK's extra fields are ignored, not refused.
        .ignore_unknown_fields()
        .build(&[".process", ".filesystem"])?;
    Ok(())
}
