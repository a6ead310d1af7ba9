#![no_main]
//! The egress proxy's TLS SNI and HTTP Host parsers.

libfuzzer_sys::fuzz_target!(|data: &[u8]| space_node::fuzzing::sniff(data));
