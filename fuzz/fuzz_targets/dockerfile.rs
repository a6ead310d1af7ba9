#![no_main]
//! The Dockerfile parser of template builds.

libfuzzer_sys::fuzz_target!(|data: &[u8]| space_control::http::fuzzing::dockerfile(data));
