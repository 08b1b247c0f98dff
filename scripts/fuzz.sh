#!/usr/bin/env bash
# Runs one fuzz target for a number of minutes:
#
#   scripts/fuzz.sh parse 30        # or: program, store
#
# Needs the nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`).
# New inputs go to fuzz/work/TARGET (not committed); at the end the
# committed corpus fuzz/corpus/TARGET is replaced by a minimal set of old
# and new inputs that covers every edge either saw.
# A crash is written to fuzz/artifacts/TARGET/: minimize it with
# `cargo +nightly fuzz tmin TARGET FILE`, fix the bug, and commit the
# minimized input to fuzz/regressions/TARGET/, which `cargo test` replays
# (tests/tests/fuzz_corpus.rs; backend-nccl/tests/store_corpus.rs for
# store). Extra arguments go to libFuzzer.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 TARGET MINUTES [libFuzzer options...]  (TARGET: parse, program or store)" >&2
    exit 2
fi
target=$1
minutes=$2
shift 2
cd "$(dirname "$0")/../fuzz"
mkdir -p "work/$target" "corpus/$target" "regressions/$target"
flags=(--sanitizer none --debug-assertions --release)
cargo +nightly fuzz build "${flags[@]}" "$target"
start=$(date +%s)
status=0
cargo +nightly fuzz run "${flags[@]}" "$target" "work/$target" "corpus/$target" "regressions/$target" -- \
    -max_total_time=$((minutes * 60)) -timeout=60 -print_final_stats=1 "$@" || status=$?
echo "fuzz.sh: $target ran $(( $(date +%s) - start )) s, exit status $status"
# Keep the committed corpus small: of the old corpus and the new inputs, a
# set that covers every edge seen (a set cover; hit counts ignored).
min="work/$target.min"
rm -rf "$min"
mkdir -p "$min"
cargo +nightly fuzz run "${flags[@]}" "$target" "$min" "corpus/$target" "work/$target" -- \
    -set_cover_merge=1 -use_counters=0
rm -rf "corpus/$target"
mv "$min" "corpus/$target"
echo "fuzz.sh: corpus/$target now holds $(ls "corpus/$target" | wc -l) inputs"
exit "$status"
