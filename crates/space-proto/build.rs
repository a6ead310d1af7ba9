//! Compiles proto/guest.proto and proto/node.proto with protox (pure Rust; no system protoc
//! needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/guest.proto");
    println!("cargo:rerun-if-changed=proto/node.proto");
    let fds = protox::compile(["proto/guest.proto", "proto/node.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
