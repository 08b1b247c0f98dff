//! The schedule parser on arbitrary bytes: see `duplex_sim::fuzzing::parse`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| duplex_sim::fuzzing::parse(data));
