//! The rendezvous store's wire protocol on arbitrary bytes: see
//! `duplex_nccl::store::fuzz_parse`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| duplex_nccl::store::fuzz_parse(data));
