#!/usr/bin/env bash
# The GPU nightly (`scripts/gpu.sh nightly`), on a machine with 2 GPUs, NCCL
# and PyTorch: builds the release binaries into .gpu/ where cargo is (else
# uses the staged .gpu/), runs every step of `scripts/gpu.sh run all` (the
# conformance suite, the fault matrix, the calibration, the benchmarks with
# BENCH_TRIALS trials each against docs/gpu/bench-baseline.json, and the
# lane-settings table, lanes.md, reported and not judged), writes
# every report under $OUT (default ./gpu-out), and judges them with
# scripts/nightly_verdict.py into $OUT/nightly.md and nightly.json.
#
# The whole matrix, whatever the caller's environment: before running, it
# unsets the duplex variables that shrink or change what the steps run
# (and says so in nightly.log): DUPLEX_ONE_GPU (the process jobs only, on
# GPU 0), DUPLEX_LANES and DUPLEX_LANE_CONNECT (lanes made on first use or
# connected one way, in every step), DUPLEX_COLD (every communicator
# connected on first use), DUPLEX_IPC_COPY (adds the experimental
# copy-engine jobs across processes) and DUPLEX_SCENARIO (the suite would
# run that one job as a child and nothing else). suite-lazy and suite-cold
# set their own. Kept: DUPLEX_TIMEOUT_MS (gpu.sh's deadline, a setting),
# DUPLEX_NCCL_LIBRARY (which NCCL) and DUPLEX_LOG (logging).
#
# Exit status: 0 when every step passed; 1 when the build failed, a suite
# scenario failed, a fault case failed, the calibration disagrees with the
# model (beyond scripts/nightly-known.txt), or a benchmark figure has every
# trial worse than the baseline's band widened by the slack (BENCH_SLACK,
# default 5% of the baseline's median on each side), was not measured, has
# no baseline (never judged: the message says how to rewrite the baseline),
# changed unit or has fewer than 5 trials; 2 for a wrong invocation.
#
#   NIGHTLY_BUILD=0   never build; use the staged .gpu/
#   OUT=DIR           where the reports go (made if missing)
# and every variable of `scripts/gpu.sh run` (BENCH_TRIALS, at least 5:
# fewer is refused with exit status 2, since no figure of fewer trials is
# judged; BENCH_BASELINE, BENCH_TOLERANCE, BENCH_SLACK, SUITE_S, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 0 ] || { sed -n '2,34p' "$0"; exit 2; }
case "${BENCH_TRIALS:-5}" in
  ''|*[!0-9]*) trials_ok=0 ;;
  *) trials_ok=$(( 10#${BENCH_TRIALS:-5} >= 5 )) ;;
esac
if [ "$trials_ok" != 1 ]; then
  echo "gpu-nightly: BENCH_TRIALS=${BENCH_TRIALS} is not a whole number of at least 5: the nightly judges no benchmark figure of fewer trials (bench_table.py --min-trials)" >&2
  exit 2
fi
out=${OUT:-gpu-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export OUT=$out
: > "$out/steps.txt"
echo "nightly: $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse HEAD 2>/dev/null || echo unknown), reports in $out" \
  | tee "$out/nightly.log"
for v in DUPLEX_ONE_GPU DUPLEX_LANES DUPLEX_LANE_CONNECT DUPLEX_COLD DUPLEX_IPC_COPY DUPLEX_SCENARIO; do
  if [ -n "${!v+set}" ]; then
    echo "unset $v (was '${!v}'): it shrinks or changes what the nightly runs" | tee -a "$out/nightly.log"
    unset "$v"
  fi
done

built=0
if [ "${NIGHTLY_BUILD:-1}" != 0 ] && command -v cargo > /dev/null; then
  set +e
  scripts/gpu.sh build 2>&1 | tee "$out/build.log"
  rc=${PIPESTATUS[0]}
  set -e
  echo "build $rc" >> "$out/steps.txt"
  [ "$rc" = 0 ] && built=1
elif [ -x .gpu/duplex ] && [ -x .gpu/nccl-suite ] && [ -x .gpu/faults ] && [ -x .gpu/bench ]; then
  echo "no build (NIGHTLY_BUILD=0 or no cargo): using the staged .gpu/" | tee -a "$out/nightly.log"
  echo "build staged" >> "$out/steps.txt"
  built=1
else
  echo "no cargo and no complete .gpu/ (scripts/gpu.sh build stages one)" | tee -a "$out/nightly.log"
  echo "build 127" >> "$out/steps.txt"
fi

if [ "$built" = 1 ]; then
  # `run` records each command's exit status in steps.txt and goes on past
  # failures; its own status only says whether it could run at all.
  scripts/gpu.sh run suite suite-lazy suite-cold faults faults-lazy calibrate bench lanes ipc 2>&1 | tee -a "$out/nightly.log" || true
fi

exec python3 scripts/nightly_verdict.py "$out" --known scripts/nightly-known.txt
