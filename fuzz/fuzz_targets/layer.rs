#![no_main]
//! Image-layer (tar) extraction into a rootfs.

libfuzzer_sys::fuzz_target!(|data: &[u8]| space_unpack::fuzzing::layer(data));
