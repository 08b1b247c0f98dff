#!/usr/bin/env bash
# Prints, for every example, the checker's verdict, executions, host steps,
# branching states and time, with and without the partial-order reduction.
# Usage: scripts/check-examples.sh [--write]: prints the table; with
# --write, also puts it in docs/checker-stats.md in place of the file's head
# and first table, keeping what follows (the notes on each regeneration and
# the "## Benchmark" part, which scripts/checker-bench.sh --write updates).
set -euo pipefail
cd "$(dirname "$0")/.."
write=0
if [ "${1:-}" = "--write" ]; then write=1; shift; fi
cargo build --release -q
bin=target/release/duplex
table() {
cat <<'HEAD'
# Checker statistics on every example

Produced by `scripts/check-examples.sh --write` (release build). The checker is a
depth-first search over persistent sets (`duplex_sim::check`): *executions*
are paths it followed, *steps* the host steps taken, *branching* the
distinct states with more than one choice it stored (states where the
reduction leaves one choice are stepped through, not stored). Times are
wall-clock on a 2-core machine and noisy below a millisecond.

| example | verdict | executions | steps | branching | time (s) | executions, no reduction | steps, no reduction | time (s), no reduction |
|---|---|---|---|---|---|---|---|---|
HEAD
for f in examples/*.sched; do
  r=$($bin check "$f" --format json || true)
  n=$($bin check "$f" --format json --no-reduction || true)
  python3 - "$f" "$r" "$n" <<'PY'
import json, sys
f, r, n = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
s, t = r['stats'], n['stats']
print(f"| {f.split('/')[-1]} | {r['verdict']} | {s['executions']} | {s['transitions']} | {s['states']} | {s['elapsed']:.4f} | {t['executions']} | {t['transitions']} | {t['elapsed']:.4f} |")
PY
done
}
text=$(table)
echo "$text"
if [ $write = 1 ]; then
  python3 - "$text" <<'PY'
import sys
p = "docs/checker-stats.md"
lines = open(p).read().splitlines(keepends=True)
# The old head and table end at the first line after the first table's rows.
rows = [i for i, l in enumerate(lines) if l.startswith("|")]
end = rows[0] if rows else 0
while end < len(lines) and lines[end].startswith("|"):
    end += 1
open(p, "w").write(sys.argv[1].rstrip() + "\n" + "".join(lines[end:]))
PY
fi
