#![no_main]
//! Guest-protocol replies as the control plane converts them for clients.

libfuzzer_sys::fuzz_target!(|data: &[u8]| space_control::http::fuzzing::guest_reply(data));
