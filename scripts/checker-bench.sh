#!/usr/bin/env bash
# The checker's benchmark (issue 10's families and targets): builds the
# release example and prints its table; with --write, replaces the table in
# docs/checker-stats.md. Usage: scripts/checker-bench.sh [--write] [SECONDS]
# (SECONDS: the time limit of each family, default 30).
set -euo pipefail
cd "$(dirname "$0")/.."
write=0
if [ "${1:-}" = "--write" ]; then write=1; shift; fi
limit=${1:-30}
cargo build --release -q -p duplex-sim --example scale
table=$(target/release/examples/scale --limit "$limit")
echo "$table"
if [ $write = 1 ]; then
  python3 - "$table" "$limit" <<'PY'
import re, sys
table, limit = sys.argv[1], sys.argv[2]
p = "docs/checker-stats.md"
s = open(p).read()
start = s.find("## Benchmark")
head = s if start < 0 else s[:start]
open(p, "w").write(head.rstrip() + "\n\n## Benchmark\n\nProduced by `scripts/checker-bench.sh --write " + limit + "` (release build, each family in a process of its own, time limit " + limit + " s, on this 2-core machine). `met` compares with issue 10's targets; `-` marks a size measured for scaling.\n\n" + table + "\n")
PY
fi
