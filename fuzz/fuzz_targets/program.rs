//! Random programs against the checker's invariants: see
//! `duplex_tests::fuzzing::program`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| duplex_tests::fuzzing::program(data));
