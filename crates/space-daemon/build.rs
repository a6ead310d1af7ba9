//! space-daemon links as a position-dependent static executable (decision 0063): a static-pie
//! relocates its ~160 KiB of relocation-read-only data at every start, which makes those
//! pages private to each sandbox; without relocations they stay shared page cache across all
//! of a node's sandboxes. The workspace builds every crate with one set of flags (decision
//! 0026), so only this binary's link asks for it: the last of gcc's `-static-pie` (rustc's)
//! and `-no-pie -static` (these) wins. Its libraries are compiled position-independent, which
//! a position-dependent link takes as they are. Tests and other targets are unchanged.
//! `scripts/test` checks the result.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let target = std::env::var("TARGET").unwrap_or_default();
    let static_crt = std::env::var("CARGO_CFG_TARGET_FEATURE")
        .unwrap_or_default()
        .split(',')
        .any(|f| f == "crt-static");
    if static_crt && target.contains("linux-gnu") {
        println!("cargo:rustc-link-arg-bins=-no-pie");
        println!("cargo:rustc-link-arg-bins=-static");
    }
}
