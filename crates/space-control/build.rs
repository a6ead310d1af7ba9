//! Compiles the E2B envd protocol (proto/e2b/*.proto) with protox (pure Rust; no system
//! protoc), prost for the messages and pbjson for their proto3 JSON mapping, which is the
//! codec E2B's SDKs speak (decision 0022). Embeds the web console's built files
//! (`console/dist`, decision 0058).

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
    embed_console()?;
    Ok(())
}

/// Writes `$OUT_DIR/console_assets.rs`: one `(name, bytes)` entry per file of
/// `console/dist` (`scripts/lib.sh build_console` makes it). Without one, no entry: the
/// console's handler then answers with the page that says how to build it.
fn embed_console() -> Result<(), Box<dyn std::error::Error>> {
    use std::fmt::Write as _;
    let dist =
        std::path::Path::new(&std::env::var("CARGO_MANIFEST_DIR")?).join("../../console/dist");
    println!("cargo:rerun-if-changed={}", dist.display());
    let mut names: Vec<std::path::PathBuf> = match std::fs::read_dir(&dist) {
        Ok(rd) => rd
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
            .map(|e| e.path())
            .collect(),
        Err(_) => Vec::new(),
    };
    names.sort();
    let mut out = String::from("&[\n");
    for path in &names {
        println!("cargo:rerun-if-changed={}", path.display());
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or("odd file name in console/dist")?;
        let abs = std::fs::canonicalize(path)?;
        writeln!(
            out,
            "    ({name:?}, include_bytes!({:?}) as &[u8]),",
            abs.display().to_string()
        )?;
    }
    out.push(']');
    let target = std::path::Path::new(&std::env::var("OUT_DIR")?).join("console_assets.rs");
    std::fs::write(target, out)?;
    Ok(())
}
