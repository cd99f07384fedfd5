//! Lanyard's fuzz target bodies, as a library the `fuzz_targets/` binaries
//! call. The bodies are in [`bodies`]; see there for why they are shared
//! with the main crate's `tests/fuzz_corpus.rs` this way.

pub mod bodies;
