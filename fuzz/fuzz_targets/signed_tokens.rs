//! libFuzzer entry point; the body is [`lanyard_fuzz::bodies::signed_tokens`], which
//! `tests/fuzz_corpus.rs` replays on stable.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| lanyard_fuzz::bodies::signed_tokens::run(data));
