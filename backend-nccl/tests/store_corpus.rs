//! Replays the `store` fuzz target's committed corpus (`fuzz/corpus/store/`)
//! and every past crash (`fuzz/regressions/store/`) through the harness the
//! target calls (`duplex_nccl::store::fuzz_parse`), on the stable toolchain,
//! so that `cargo test` keeps every fuzzing finding fixed. As
//! `tests/tests/fuzz_corpus.rs` does for the simulator's targets;
//! `scripts/fuzz.sh store MINUTES` runs the fuzzer itself.

use std::path::{Path, PathBuf};

use duplex_nccl::store::proto::{parse_request, parse_response, read_line};

fn files(dir: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz")
        .join(dir)
        .join("store");
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

#[test]
fn the_store_corpus_and_its_regressions_pass() {
    let corpus = files("corpus");
    let regressions = files("regressions");
    let (mut requests, mut responses, mut refused) = (0, 0, 0);
    for path in corpus.iter().chain(&regressions) {
        let data = std::fs::read(path).expect("readable input");
        let result = std::panic::catch_unwind(|| duplex_nccl::store::fuzz_parse(&data));
        assert!(
            result.is_ok(),
            "fuzz target `store` fails on {}",
            path.display()
        );
        let mut stream = std::io::Cursor::new(&data);
        while let Ok(line) = read_line(&mut stream) {
            if line.is_empty() {
                break;
            }
            match (parse_request(&line), parse_response(&line)) {
                (Ok(_), _) => requests += 1,
                (_, Ok(_)) => responses += 1,
                _ => refused += 1,
            }
        }
    }
    assert!(
        corpus.len() >= 10,
        "fuzz/corpus/store holds only {} inputs",
        corpus.len()
    );
    // The seeds hold valid requests and responses as well as hostile lines.
    assert!(
        requests > 0 && responses > 0 && refused > 0,
        "{requests} requests, {responses} responses, {refused} refused lines"
    );
}
