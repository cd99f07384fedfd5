//! Replays the fuzz corpus on stable, in the normal test command: every
//! seed in `fuzz/corpus/<target>/` and every crash kept in
//! `fuzz/artifacts/<target>/` goes through the same body the cargo-fuzz
//! target runs (`fuzz/src/bodies/`, compiled here by `#[path]`), and must
//! not panic. Fuzzing itself needs nightly and time (`scripts/fuzz`); this
//! keeps what it found fixed without either.
//!
//! The bodies are shared by path rather than through a `fuzzing` feature
//! of `lanyard`: they use only its public API, so the product carries no
//! fuzzing code, and the fuzz crate stays out of the workspace.

#[path = "../fuzz/src/bodies/mod.rs"]
mod bodies;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// The files of `dir`, sorted; none when it does not exist.
fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_file())
        // libFuzzer's and our own notes beside the inputs.
        .filter(|p| {
            !p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    files.sort();
    files
}

#[test]
fn corpus_and_past_crashes_replay_without_a_panic() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut failures = Vec::new();
    let mut replayed = 0;
    for (target, body) in bodies::TARGETS {
        let seeds = inputs(&root.join("corpus").join(target));
        assert!(
            !seeds.is_empty(),
            "fuzz/corpus/{target}/ has no seed inputs"
        );
        let crashes = inputs(&root.join("artifacts").join(target));
        for file in seeds.iter().chain(&crashes) {
            let data = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            replayed += 1;
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| body(&data))) {
                let message = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("(no message)");
                failures.push(format!("{target}: {}: {message}", file.display()));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {replayed} fuzz inputs panic:\n{}",
        failures.len(),
        failures.join("\n")
    );
    eprintln!("replayed {replayed} fuzz inputs");
}
