//! The schedule parser on arbitrary bytes: see `duplex_tests::fuzzing::parse`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| duplex_tests::fuzzing::parse(data));
