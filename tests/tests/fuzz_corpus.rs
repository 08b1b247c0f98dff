//! Replays the fuzzers' committed corpus (`fuzz/corpus/TARGET/`) and every
//! past crash (`fuzz/regressions/TARGET/`) through the harnesses the fuzz
//! targets call (`duplex_tests::fuzzing`), on the stable toolchain, so that
//! `cargo test` keeps every fuzzing finding fixed. `scripts/fuzz.sh` runs
//! the fuzzers themselves.

use std::path::{Path, PathBuf};

fn files(target: &str, dir: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz")
        .join(dir)
        .join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("readable directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// Runs `harness` on every file of the target's corpus and regressions;
/// a panic names the file. Returns how many files of each there were.
fn replay(target: &str, harness: fn(&[u8])) -> (usize, usize) {
    let corpus = files(target, "corpus");
    let regressions = files(target, "regressions");
    for path in corpus.iter().chain(&regressions) {
        let data = std::fs::read(path).expect("readable input");
        let result = std::panic::catch_unwind(|| harness(&data));
        assert!(
            result.is_ok(),
            "fuzz target `{target}` fails on {}",
            path.display()
        );
    }
    (corpus.len(), regressions.len())
}

#[test]
fn the_parse_corpus_and_its_regressions_pass() {
    let (corpus, _) = replay("parse", duplex_tests::fuzzing::parse);
    assert!(corpus >= 10, "fuzz/corpus/parse holds only {corpus} inputs");
}

#[test]
fn the_program_corpus_and_its_regressions_pass() {
    let (corpus, _) = replay("program", duplex_tests::fuzzing::program);
    assert!(
        corpus >= 10,
        "fuzz/corpus/program holds only {corpus} inputs"
    );
}
