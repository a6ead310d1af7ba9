#![no_main]
//! A slot's DNS server: the sandbox's query, then the upstream's answer.

libfuzzer_sys::fuzz_target!(|data: &[u8]| space_node::fuzzing::dns(data));
