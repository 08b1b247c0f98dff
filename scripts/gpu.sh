#!/usr/bin/env bash
# The whole GPU run of duplex, in two halves.
#
#   scripts/gpu.sh build          here (no GPU needed): builds the release
#                                 binaries and stages them, with the examples
#                                 and scripts, in .gpu/
#   scripts/gpu.sh run [WHAT...]  there (a machine with 2 GPUs, NCCL and
#                                 PyTorch; no Rust needed): runs WHAT from
#                                 .gpu/ and writes reports to $OUT (default
#                                 ./gpu-out). WHAT: suite faults calibrate bench all
#
# With the `device` tool: build here, then
#   run(command="scripts/gpu.sh run all", carry=[".gpu"], kind="nvidia-h200-x2")
# and copy the reports back into the repo (docs/gpu/).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-}
case "$what" in
build)
  cargo build --release -p duplex-cli -p duplex-nccl --examples --bins
  suite=$(cargo test --release -p duplex-tests --test nccl --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="nccl": print(m["executable"])' | tail -1)
  rm -rf .gpu && mkdir -p .gpu
  cp target/release/duplex .gpu/
  cp "$suite" .gpu/nccl-suite
  cp target/release/examples/bench .gpu/ 2>/dev/null || true
  cp target/release/examples/faults .gpu/
  cp -r examples .gpu/examples
  cp scripts/bench_torch.py scripts/bench_table.py .gpu/ 2>/dev/null || true
  ls -la .gpu
  ;;
run)
  shift
  out=${OUT:-gpu-out}
  mkdir -p "$out"
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export DUPLEX_NCCL_LIBRARY=${DUPLEX_NCCL_LIBRARY:-/usr/lib/x86_64-linux-gnu/libnccl.so.2}
  [ -e "$DUPLEX_NCCL_LIBRARY" ] || unset DUPLEX_NCCL_LIBRARY
  steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(all)
  [ "${steps[0]}" = all ] && steps=(suite faults calibrate bench)
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } > "$out/machine.txt" 2>&1 || true
  for s in "${steps[@]}"; do
    case "$s" in
    suite)
      # The suite's test is #[ignore]d (a CPU-only `cargo test` shows it as
      # ignored); --ignored runs it.
      DUPLEX_TIMEOUT_MS=${DUPLEX_TIMEOUT_MS:-3000} timeout ${SUITE_S:-240} .gpu/nccl-suite --ignored --nocapture --test-threads=1 2>&1 | tee "$out/suite.txt" || true ;;
    faults)
      # The fault matrix (backend-nccl/examples/faults.rs): every case's
      # survivors must end by themselves, with an error naming the failed
      # rank, within deadline + grace; its table goes to docs/gpu/faults.md.
      timeout ${FAULTS_S:-500} .gpu/faults drive --out "$out/faults.md" 2>&1 | tee "$out/faults.log" || true
      { echo; echo "Produced by: scripts/gpu.sh run faults"; } >> "$out/faults.md" ;;
    calibrate)
      timeout ${CALIBRATE_S:-200} .gpu/duplex calibrate .gpu/examples --timeout-ms 2000 --format markdown > "$out/calibration.md" 2> "$out/calibration.log" || true
      tail -5 "$out/calibration.log"; cat "$out/calibration.md" ;;
    bench)
      timeout ${BENCH_S:-90} .gpu/bench --json "$out/bench-duplex.json" 2>&1 | tee "$out/bench-log.txt" || true
      # Lane CTA bounds, 256 MiB only: what duplex's defaults leave on the table.
      for c in 16 32 64; do
        echo "== lane CTAs $c" >> /tmp/bench-sweep.txt
        timeout 40 .gpu/bench --quick --min-ctas $c --max-ctas $c 2>/dev/null | grep -E "^ +[0-9]+MiB|^duplex" >> /tmp/bench-sweep.txt || echo "failed" >> /tmp/bench-sweep.txt
      done
      cat /tmp/bench-sweep.txt | tee -a "$out/bench-log.txt"
      (cd .gpu && timeout ${TORCH_S:-120} python3 bench_torch.py "$out/bench-torch.json") 2>&1 | grep -v "Warning: \[PG\|TORCH_NCCL" | tee -a "$out/bench-log.txt" || true
      python3 .gpu/bench_table.py "$out/bench-duplex.json" "$out/bench-torch.json" > "$out/benchmarks.md" 2>&1 || true
      { echo; echo '### Lane CTA bounds (256 MiB, duplex only)'; echo; echo '```'; cat /tmp/bench-sweep.txt; echo '```'; } >> "$out/benchmarks.md"
      cat "$out/benchmarks.md" ;;
    *) echo "unknown step $s"; exit 2 ;;
    esac
  done
  ;;
*) sed -n '2,14p' "$0"; exit 2 ;;
esac
