#!/usr/bin/env bash
# Prints, for every example, the checker's verdict, executions, host steps,
# branching states and time, with and without the partial-order reduction.
# Usage: scripts/check-examples.sh > docs/checker-stats.md
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q
bin=target/release/duplex
cat <<'HEAD'
# Checker statistics on every example

Produced by `scripts/check-examples.sh` (release build). The checker is a
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
