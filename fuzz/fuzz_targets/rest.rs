#![no_main]
//! REST bodies and query strings, and E2B's Connect envelopes (space_control::http::fuzzing::rest).

libfuzzer_sys::fuzz_target!(|data: &[u8]| space_control::http::fuzzing::rest(data));
