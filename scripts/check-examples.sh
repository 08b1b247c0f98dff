#!/usr/bin/env bash
# Prints, for every example, the checker's verdict, states and time, with
# and without the partial-order reduction. Usage: scripts/check-examples.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q
bin=target/release/duplex
printf '| example | verdict | states | time (s) | states, no reduction | time (s), no reduction |\n|---|---|---|---|---|---|\n'
for f in examples/*.sched; do
  r=$($bin check "$f" --format json || true)
  n=$($bin check "$f" --format json --no-reduction || true)
  python3 - "$f" "$r" "$n" <<'PY'
import json, sys
f, r, n = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
print(f"| {f.split('/')[-1]} | {r['verdict']} | {r['stats']['states']} | {r['stats']['elapsed']:.4f} | {n['stats']['states']} | {n['stats']['elapsed']:.4f} |")
PY
done
