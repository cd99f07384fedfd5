//! Link settings for Lanyard's executables.
//!
//! Relative relocations are packed (`-z pack-relative-relocs`, DT_RELR):
//! a position-independent executable otherwise carries one 24-byte
//! `.rela.dyn` entry per pointer in its read-only data (vtables, string
//! tables), about 1 MB for `lanyard` and 0.5 MB for `lanyard-sidecar`,
//! which the loader reads at every start and which then stays resident.
//! Packed, the same relocations take a few kilobytes, and the executables
//! stay position-independent (ASLR). Needs glibc 2.36 or later at run
//! time for dynamically linked builds (the image's are static) and GNU ld
//! 2.38 or later to link.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let var = |name: &str| std::env::var(name).unwrap_or_default();
    if var("CARGO_CFG_TARGET_OS") == "linux" && var("CARGO_CFG_TARGET_ENV") == "gnu" {
        println!("cargo:rustc-link-arg=-Wl,-z,pack-relative-relocs");
    }
}
