#!/usr/bin/env bash
# The whole GPU run of duplex, in two halves, and the nightly that does both.
#
#   scripts/gpu.sh build          here (no GPU needed): builds the release
#                                 binaries and stages them, with the examples
#                                 and scripts, in .gpu/
#   scripts/gpu.sh run [WHAT...]  there (a machine with 2 GPUs, NCCL and
#                                 PyTorch; no Rust needed): runs WHAT from
#                                 .gpu/ and writes reports to $OUT (default
#                                 ./gpu-out). WHAT: suite suite-lazy suite-cold faults faults-lazy calibrate bench lanes ipc ipc-copy all,
#                                 or one-gpu, calibrate-1gpu (on a machine with one GPU only),
#                                 calibrate-processes (a process per rank)
#   scripts/gpu.sh nightly        there, with or without Rust: build (where
#                                 cargo is; else the staged .gpu/), run all,
#                                 judge (scripts/gpu-nightly.sh); exits 1 when
#                                 a scenario or fault case fails, the
#                                 calibration disagrees, or a benchmark's
#                                 every trial is worse than the band of
#                                 docs/gpu/bench-baseline.json widened by
#                                 the slack (or has no baseline)
#
# `run` goes on past a failing step; it records each command's exit status
# in $OUT/steps.txt (NAME STATUS), which the nightly's verdict reads
# (scripts/nightly_verdict.py). `bench` takes every figure in BENCH_TRIALS
# trials (default 5) and writes benchmarks.md: medians [min–max], the
# targets, and the comparison with BENCH_BASELINE (default
# docs/gpu/bench-baseline.json; a missing or unreadable one fails the
# bench-table step). The bench-table step fails when a figure's every
# trial is worse than the baseline's band, its [min, max] widened by the
# slack, BENCH_SLACK of its median on each side (default 0.05), or
# ±BENCH_TOLERANCE (default 0.10) for a baseline figure of one trial; or
# when a figure was not measured, has no baseline, changed unit, or has
# fewer than 5 trials (scripts/bench_table.py --strict). Time limits:
# SUITE_S FAULTS_S CALIBRATE_S BENCH_S TORCH_S seconds.
#
# With the `device` tool (which brings back at most 8 files, and one call
# runs at most 10 minutes): build here, then two calls,
#   run(command="OUT=/tmp/r FAULTS_S=220 SUITE_S=200 CALIBRATE_S=170 scripts/gpu.sh run faults suite calibrate; tar czf $OUT/r.tgz -C /tmp/r .; cat /tmp/r/steps.txt",
#       carry=[".gpu"], kind="nvidia-h200-x2", timeout_s=600)
#   run(command="OUT=/tmp/r BENCH_CTAS=64 scripts/gpu.sh run bench; tar czf $OUT/r.tgz -C /tmp/r .", ...)
# and, for lane memory (issue 12, item 3), a third,
#   run(command="OUT=/tmp/r scripts/gpu.sh run lanes; tar czf $OUT/r.tgz -C /tmp/r .; cat /tmp/r/lanes.md", ...)
# (the suite has 60 jobs: 34 with a thread per rank, 26 with a process
# per rank, five of them the scenarios of four ranks with every rank on
# GPU 0, and 7 more process jobs with DUPLEX_IPC_COPY=1; it had 21
# when it last ran on two GPUs, in 111 s, so SUITE_S may need
# raising), and for lanes made on first use (issue 12, item 3) a fourth,
#   run(command="OUT=/tmp/r SUITE_S=280 FAULTS_S=260 scripts/gpu.sh run suite-lazy faults-lazy ipc; tar czf $OUT/r.tgz -C /tmp/r .; tail -40 /tmp/r/suite-lazy.txt; cat /tmp/r/steps.txt /tmp/r/ipc.md /tmp/r/ipc-flags.md", ...)
# and for copy-engine lanes across processes (experimental; issue 12 item
# 4), a fifth,
#   run(command="OUT=/tmp/r scripts/gpu.sh run ipc-copy; tar czf $OUT/r.tgz -C /tmp/r .; cat /tmp/r/steps.txt", ...)
# and every job with its communicators connected on first use, a sixth,
#   run(command="OUT=/tmp/r scripts/gpu.sh run suite-cold; tar czf $OUT/r.tgz -C /tmp/r .; cat /tmp/r/steps.txt", ...)
# and copy the reports back into the repo (docs/gpu/). When only the
# one-GPU kind is lent, the process-per-rank behaviour still runs (~6 min
# with the machine's start: the suite and the fault matrix eager and lazy,
# the IPC copy jobs IPC_RUNS times (default 1; each ~100 s), copylane; on
# 2026-12-02 three copy runs did not fit in a 480 s call, and a call cut
# short brings nothing back from /tmp/r):
#   run(command="OUT=/tmp/r ONE_GPU_PARTS='eager lazy' timeout 560 scripts/gpu.sh run one-gpu; tar czf $OUT/r.tgz -C /tmp/r .; cat /tmp/r/steps.txt",
#       carry=[".gpu"], kind="nvidia-h200", timeout_s=600)
# and a second call with ONE_GPU_PARTS='cold ipc-copy copylane' (the whole
# step no longer fits one call: 26 process jobs, each part ~2-4 min)
# To see why a fault case ended as it did: `.gpu/faults drive --only CASE
# --logs DIR` keeps each child's duplex tracing events (DUPLEX_LOG, default
# debug) in DIR/CASE-MODE-rankN.log, and the log gives each rank's whole
# verdict with when it came and when the process ended.
# The bench step's lane-CTA sweep: BENCH_CTAS (default "16 32 64", empty
# for none), each a `bench --quick --no-copy` of its own (~20-30 s). The
# lanes step: NCCL's defaults, then each of BENCH_LANE_ENV (NCCL
# environments, each a comma-joined KEY=VALUE list; default below, whose
# last two are duplex's: DUPLEX_LANES=lazy makes each lane on first use,
# DUPLEX_LANE_CONNECT=one-way connects each lane in its own direction only), each a
# `bench --quick --no-copy` process of its own (NCCL reads them when a
# process makes its first communicator), into lanes.md: each setting's
# lane memory, creation time and 256 MiB bandwidths beside the defaults'.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-}

# record NAME STATUS: one line of $out/steps.txt.
record() { echo "$1 $2" >> "$out/steps.txt"; }

case "$what" in
build)
  cargo build --release -p duplex-cli -p duplex-nccl --examples --bins
  # The GPU suite's test binary, which cargo's JSON names. rustc's rendered
  # diagnostics (carried in that JSON) and cargo's own stderr go to the log,
  # so that a failed build shows its errors, and fails here.
  suite=$(cargo test --release -p duplex-tests --test nccl --no-run --message-format=json \
    | python3 -c 'import json,sys
exe = None
for l in sys.stdin:
    try:
        m = json.loads(l)
    except ValueError:
        sys.stderr.write(l)
        continue
    if m.get("reason") == "compiler-message" and (m.get("message") or {}).get("rendered"):
        sys.stderr.write(m["message"]["rendered"])
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "nccl":
        exe = m["executable"]
if exe:
    print(exe)') \
    || { echo "gpu.sh build: the GPU suite (tests/tests/nccl.rs) did not build: its errors are above" >&2; exit 1; }
  [ -n "$suite" ] || { echo "gpu.sh build: cargo named no test binary for the GPU suite (tests/tests/nccl.rs)" >&2; exit 1; }
  rm -rf .gpu && mkdir -p .gpu
  cp target/release/duplex .gpu/
  cp "$suite" .gpu/nccl-suite
  cp target/release/examples/bench .gpu/
  cp target/release/examples/faults .gpu/
  cp target/release/examples/overhead .gpu/
  cp target/release/examples/copylane .gpu/
  # The same with frame pointers, for `overhead --spin S --profile FILE`
  # (its samples then name callers: scripts/profile_symbols.py).
  CARGO_TARGET_DIR=target/fp RUSTFLAGS="-C force-frame-pointers=yes" \
    cargo build --release -p duplex-nccl --example overhead
  cp target/fp/release/examples/overhead .gpu/overhead-fp
  # Without their line tables (55 MiB -> 11 MiB, under the device tool's
  # 64 MiB a call may carry); symbols stay, for debugger stacks, and the
  # code is unchanged, so a profile names its samples from the unstripped
  # build here (scripts/profile_symbols.py FILE target/fp/release/examples/overhead).
  if command -v strip >/dev/null; then
    strip --strip-debug .gpu/duplex .gpu/nccl-suite .gpu/bench .gpu/faults .gpu/overhead .gpu/overhead-fp .gpu/copylane
  fi
  cp -r examples .gpu/examples
  cp scripts/bench_torch.py scripts/bench_table.py .gpu/
  ls -la .gpu
  ;;
run)
  shift
  out=${OUT:-gpu-out}
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  trials=${BENCH_TRIALS:-5}
  baseline=${BENCH_BASELINE:-docs/gpu/bench-baseline.json}
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export DUPLEX_NCCL_LIBRARY=${DUPLEX_NCCL_LIBRARY:-/usr/lib/x86_64-linux-gnu/libnccl.so.2}
  [ -e "$DUPLEX_NCCL_LIBRARY" ] || unset DUPLEX_NCCL_LIBRARY
  steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(all)
  [ "${steps[0]}" = all ] && steps=(suite suite-lazy suite-cold faults faults-lazy calibrate bench lanes ipc)
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } > "$out/machine.txt" 2>&1 || true
  for s in "${steps[@]}"; do
    case "$s" in
    suite)
      # The suite's test is #[ignore]d (a CPU-only `cargo test` shows it as
      # ignored); --ignored runs it.
      set +e
      DUPLEX_TIMEOUT_MS=${DUPLEX_TIMEOUT_MS:-3000} timeout "${SUITE_S:-240}" .gpu/nccl-suite --ignored --nocapture --test-threads=1 2>&1 | tee "$out/suite.txt"
      record suite "${PIPESTATUS[0]}"
      set -e ;;
    suite-lazy)
      # The same suite with every lane made on first use (DUPLEX_LANES=lazy,
      # read by Local::new and Process::from_env in each child): lanes made
      # by the ranks' lane services, L1 of docs/semantics.md included
      # (scenario reply-after-wait).
      set +e
      DUPLEX_LANES=lazy DUPLEX_TIMEOUT_MS=${DUPLEX_TIMEOUT_MS:-3000} timeout "${SUITE_S:-240}" .gpu/nccl-suite --ignored --nocapture --test-threads=1 2>&1 | tee "$out/suite-lazy.txt"
      record suite-lazy "${PIPESTATUS[0]}"
      set -e ;;
    suite-cold)
      # The same suite with every communicator connected on first use
      # (DUPLEX_COLD=1, read by each child and rank: Local/Process::warm
      # (false)): each first op on a channel waits in its connection
      # handshake (R7), and every job must still end as it expects (the
      # simulator checks each scenario cold too).
      set +e
      DUPLEX_COLD=1 DUPLEX_TIMEOUT_MS=${DUPLEX_TIMEOUT_MS:-3000} timeout "${SUITE_S:-240}" .gpu/nccl-suite --ignored --nocapture --test-threads=1 2>&1 | tee "$out/suite-cold.txt"
      record suite-cold "${PIPESTATUS[0]}"
      set -e ;;
    ipc-copy)
      # Copy-engine lanes across processes (experimental, DUPLEX_IPC_COPY=1;
      # not part of `all`): the suite's six process copy jobs, each three
      # times in a pair of processes on the two GPUs. Lifting the gate waits
      # for this on two GPUs (docs/gpu/ipc-copy-1gpu.md has the one-GPU
      # runs). A job's verdict is its RESULT (the test passes either way
      # when one job is chosen): all 18 must pass.
      : > "$out/ipc-copy.txt"
      for i in 1 2 3; do
        for job in seed-rpc/copy many-in-flight/copy mixed-sizes/copy never-buffered/copy never-buffered-late/copy size-mismatch/copy; do
          DUPLEX_IPC_COPY=1 DUPLEX_SCENARIO="process:$job" DUPLEX_TIMEOUT_MS=${DUPLEX_TIMEOUT_MS:-5000} \
            timeout 90 .gpu/nccl-suite --ignored --nocapture --test-threads=1 >> "$out/ipc-copy.txt" 2>&1 || true
        done
      done
      # (libtest may print "test ... " before it on the same line.) The
      # greps below find nothing when no job said its RESULT: `|| true`, or
      # set -e (with pipefail) would end the whole run here.
      if [ "$(grep -o "RESULT PASS" "$out/ipc-copy.txt" | wc -l || true)" -eq 18 ]; then
        record ipc-copy 0
      else
        record ipc-copy 1
      fi
      grep -o "RESULT .*" "$out/ipc-copy.txt" | cut -c1-200 || true ;;
    faults)
      # The fault matrix (backend-nccl/examples/faults.rs): every case's
      # survivors must end by themselves, with an error naming the failed
      # rank, within deadline + grace; its table goes to docs/gpu/faults.md.
      rm -f "$out/faults.md"
      set +e
      timeout "${FAULTS_S:-500}" .gpu/faults drive --out "$out/faults.md" 2>&1 | tee "$out/faults.log"
      record faults "${PIPESTATUS[0]}"
      set -e
      [ -e "$out/faults.md" ] && { echo; echo "Produced by: scripts/gpu.sh run faults"; } >> "$out/faults.md" ;;
    one-gpu)
      # On a machine with ONE GPU (not part of `all`): the suite's process
      # jobs and the fault matrix's process cases, each with lanes made at
      # start and on first use, the jobs cold too, both ranks on GPU 0 talking over loopback
      # sockets (DUPLEX_ONE_GPU=1, duplex_nccl::shared_gpu_env): behaviour,
      # not speed (docs/gpu/suite-1gpu.txt, docs/gpu/faults-1gpu.md).
      # ONE_GPU_PARTS picks what runs (default all of: eager lazy cold
      # ipc-copy copylane): the whole step takes more than one device
      # call's 600 s, so a session splits it, e.g. "eager lazy" in one
      # call and "cold ipc-copy copylane" in another.
      parts=" ${ONE_GPU_PARTS:-eager lazy cold ipc-copy copylane} "
      for p in $parts; do
        case $p in eager|lazy|cold|ipc-copy|copylane) ;;
          *) echo "ONE_GPU_PARTS: unknown part '$p' (eager lazy cold ipc-copy copylane)" >&2; exit 2 ;;
        esac
      done
      set +e
      for lanes in eager lazy; do
        [[ $parts == *" $lanes "* ]] || continue
        DUPLEX_ONE_GPU=1 DUPLEX_LANES=$lanes DUPLEX_TIMEOUT_MS=${DUPLEX_TIMEOUT_MS:-5000} timeout "${SUITE_S:-240}" .gpu/nccl-suite --ignored --nocapture --test-threads=1 > "$out/suite-1gpu-$lanes.txt" 2>&1
        record "suite-1gpu-$lanes" $?
        DUPLEX_ONE_GPU=1 DUPLEX_LANES=$lanes timeout "${FAULTS_S:-200}" .gpu/faults drive --out "$out/faults-1gpu-$lanes.md" > "$out/faults-1gpu-$lanes.log" 2>&1
        record "faults-1gpu-$lanes" $?
      done
      # Every job with its communicators connected on first use
      # (DUPLEX_COLD=1; suite-cold above).
      [[ $parts == *" cold "* ]] && {
      DUPLEX_COLD=1 DUPLEX_ONE_GPU=1 DUPLEX_TIMEOUT_MS=${DUPLEX_TIMEOUT_MS:-5000} timeout "${SUITE_S:-240}" .gpu/nccl-suite --ignored --nocapture --test-threads=1 > "$out/suite-1gpu-cold.txt" 2>&1
      record suite-1gpu-cold $?; }
      # Copy-engine lanes across processes (experimental, DUPLEX_IPC_COPY=1):
      # the suite's process jobs with its six copy jobs, IPC_RUNS times
      # (default 1; their known hang was intermittent, and three runs with
      # the rest took longer than one device call: docs/gpu/ipc-copy-1gpu.md).
      [[ $parts == *" ipc-copy "* ]] && for i in $(seq "${IPC_RUNS:-1}"); do
        DUPLEX_IPC_COPY=1 DUPLEX_ONE_GPU=1 DUPLEX_TIMEOUT_MS=${DUPLEX_TIMEOUT_MS:-5000} timeout "${SUITE_S:-240}" .gpu/nccl-suite --ignored --nocapture --test-threads=1 > "$out/suite-1gpu-ipc-copy-$i.txt" 2>&1
        record "suite-1gpu-ipc-copy-$i" $?
      done
      # The copy-engine lanes' own checks and figures (examples/copylane:
      # the lane of one process, both ranks on the one GPU).
      [[ $parts == *" copylane "* ]] && {
      timeout 120 .gpu/copylane --trials 3 > "$out/copylane-1gpu.txt" 2>&1
      record copylane-1gpu $?; }
      set -e
      # A summary only: a suite that printed no scenario line, or a fault
      # matrix that wrote no table, must not end the run here (set -e).
      grep -hE "^(PASS|FAIL)|^ran " "$out"/suite-1gpu-*.txt || true
      cat "$out"/faults-1gpu-*.md || true ;;
    faults-lazy)
      # The same matrix with lanes made on first use: a rank killed, frozen
      # or failing while its peers' lane services make lanes with it.
      rm -f "$out/faults-lazy.md"
      set +e
      DUPLEX_LANES=lazy timeout "${FAULTS_S:-500}" .gpu/faults drive --out "$out/faults-lazy.md" 2>&1 | tee "$out/faults-lazy.log"
      record faults-lazy "${PIPESTATUS[0]}"
      set -e
      [ -e "$out/faults-lazy.md" ] && { echo; echo "Produced by: scripts/gpu.sh run faults-lazy"; } >> "$out/faults-lazy.md" ;;
    ipc)
      # What copy-engine lanes across processes would cost (issue 12 item
      # 4): CUDA IPC handle opens and copies between two processes, on two
      # GPUs and on one (scripts/ipc_probe.py), and whether the mechanisms
      # they would use work (scripts/ipc_flags_probe.py).
      set +e
      timeout 300 python3 scripts/ipc_probe.py > "$out/ipc.md" 2> "$out/ipc.log"
      record ipc $?
      echo >> "$out/ipc.md"
      timeout 300 python3 scripts/ipc_probe.py --one-gpu >> "$out/ipc.md" 2>> "$out/ipc.log"
      record ipc-one-gpu $?
      # The mechanisms a copy-engine lane across processes would use:
      # flags in shared memory, interprocess events, whole messages.
      timeout -k 10 200 python3 scripts/ipc_flags_probe.py > "$out/ipc-flags.md" 2>> "$out/ipc.log"
      record ipc-flags $?
      echo >> "$out/ipc-flags.md"
      timeout -k 10 200 python3 scripts/ipc_flags_probe.py --one-gpu >> "$out/ipc-flags.md" 2>> "$out/ipc.log"
      record ipc-flags-one-gpu $?
      set -e
      cat "$out/ipc.md" "$out/ipc-flags.md" ;;
    calibrate)
      # Exit status 0: every example agrees; 1: some disagree; 4: no backend.
      set +e
      timeout "${CALIBRATE_S:-200}" .gpu/duplex calibrate .gpu/examples --timeout-ms 2000 --format markdown > "$out/calibration.md" 2> "$out/calibration.log"
      record calibrate $?
      set -e
      tail -5 "$out/calibration.log"; cat "$out/calibration.md" ;;
    calibrate-1gpu|calibrate-processes)
      # The calibration with a process per rank (duplex calibrate
      # --processes; not part of `all`): on two GPUs (calibrate-processes),
      # or on a machine with ONE GPU, both ranks on GPU 0 over loopback
      # sockets (calibrate-1gpu: what that transport does, not NVLink).
      set +e
      flags=(--processes); [ "$s" = calibrate-1gpu ] && flags+=(--one-gpu)
      timeout "${CALIBRATE_S:-400}" .gpu/duplex calibrate .gpu/examples "${flags[@]}" --timeout-ms 2000 --format markdown > "$out/$s.md" 2> "$out/$s.log"
      record "$s" $?
      set -e
      tail -5 "$out/$s.log"; cat "$out/$s.md" ;;
    bench)
      set +e
      timeout "${BENCH_S:-240}" .gpu/bench --trials "$trials" --json "$out/bench-duplex.json" 2>&1 | tee "$out/bench-log.txt"
      record bench "${PIPESTATUS[0]}"
      # Lane CTA bounds, 256 MiB only: what duplex's defaults leave on the
      # table (the lanes step sweeps NCCL environments).
      ctas=()
      for c in ${BENCH_CTAS-16 32 64}; do
        echo "== lane CTAs $c" | tee -a "$out/bench-log.txt"
        timeout 60 .gpu/bench --quick --no-copy --min-ctas $c --max-ctas $c --json "$out/bench-ctas-$c.json" 2>&1 | tee -a "$out/bench-log.txt" > /dev/null
        rc=${PIPESTATUS[0]}
        record "bench-ctas-$c" "$rc"
        [ "$rc" = 0 ] && ctas+=(--setting "$out/bench-ctas-$c.json")
      done
      # duplex's host time per op against raw NCCL on one GPU, with stack
      # samples' worth of detail in backend-nccl/examples/overhead/ (reported, not
      # judged: bench's two-GPU host-time figure is the judged one).
      timeout 120 .gpu/overhead --trials "$trials" > "$out/overhead.txt" 2>&1
      record overhead $?
      # Copy-engine lanes without NCCL: the mechanism's checks, raw peer
      # copies against the lane, and a compute kernel beside the copies
      # (equal times: the copies take no SMs).
      timeout 120 .gpu/copylane --trials "$trials" --limit 110 > "$out/copylane.txt" 2>&1
      record copylane $?
      (cd .gpu && timeout "${TORCH_S:-240}" python3 bench_torch.py "$out/bench-torch.json" --trials "$trials") 2>&1 \
        | grep --line-buffered -v "Warning: \[PG\|TORCH_NCCL" | tee -a "$out/bench-log.txt"
      record bench-torch "${PIPESTATUS[0]}"
      # Always compared: a baseline that is missing or unreadable is
      # bench_table's exit status 2 (the step fails), never a pass with
      # nothing compared.
      base=(--baseline "$baseline" --tolerance "${BENCH_TOLERANCE:-0.10}" --slack "${BENCH_SLACK:-0.05}")
      python3 .gpu/bench_table.py "$out/bench-duplex.json" "$out/bench-torch.json" "${base[@]}" ${ctas[@]+"${ctas[@]}"} --strict \
        > "$out/benchmarks.md" 2> "$out/bench-compare.log"
      record bench-table $?
      set -e
      cat "$out/benchmarks.md" "$out/bench-compare.log" ;;
    lanes)
      # What a lane costs under NCCL environments that may shrink it
      # (issue 12, item 3): bench-env-0 is NCCL's defaults, the reference.
      set +e
      envs=()
      n=0
      for e in "" ${BENCH_LANE_ENV-NCCL_BUFFSIZE=1048576 NCCL_MAX_P2P_NCHANNELS=8 NCCL_PROTO=Simple NCCL_BUFFSIZE=1048576,NCCL_MAX_P2P_NCHANNELS=8,NCCL_PROTO=Simple DUPLEX_LANES=lazy DUPLEX_LANE_CONNECT=one-way}; do
        echo "== lane environment ${e:-(the defaults)}" | tee -a "$out/lanes-log.txt"
        # shellcheck disable=SC2046
        timeout 60 env $(echo "$e" | tr , ' ') .gpu/bench --quick --no-copy --json "$out/bench-env-$n.json" >> "$out/lanes-log.txt" 2>&1
        rc=$?
        record "bench-env-$n" "$rc"
        [ "$rc" = 0 ] && envs+=("$out/bench-env-$n.json")
        n=$((n + 1))
      done
      python3 .gpu/bench_table.py --settings-only ${envs[@]+"${envs[@]}"} > "$out/lanes.md" 2>> "$out/lanes-log.txt"
      record lanes-table $?
      set -e
      cat "$out/lanes.md" ;;
    *) echo "unknown step $s"; exit 2 ;;
    esac
  done
  ;;
nightly)
  shift
  exec scripts/gpu-nightly.sh "$@"
  ;;
*) sed -n '2,20p' "$0"; exit 2 ;;
esac
