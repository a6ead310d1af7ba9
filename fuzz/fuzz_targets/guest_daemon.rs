#![no_main]
//! Guest-protocol requests as the daemon receives them, and a microvm session's byte stream.

libfuzzer_sys::fuzz_target!(|data: &[u8]| space_daemon::fuzzing::guest(data));
