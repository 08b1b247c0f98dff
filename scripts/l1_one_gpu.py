"""L1 of docs/semantics.md on one GPU: can NCCL set up a communicator, and
run its first group, while other work of the device waits?

Lanes made on first use (backend-nccl/src/lanes.rs) are set up while the
rank's other lanes may have kernels waiting for their peers. If a setup
step synchronized the device (as cudaFree does), it would wait for those
kernels, which may wait for that very lane: a hang. On one GPU a peer
cannot be made, so a kernel that spins on a host flag stands in for the
waiting kernel, and a 1-rank communicator stands in for the lane (its
setup: bootstrap, device memory, the device-side communicator; not the
peer connection, which needs two GPUs: `scripts/gpu.sh run suite-lazy`).

Each case runs in a child process: it starts the spinning kernel, runs the
case's host calls in a thread, and waits up to HOLD seconds for them. If
they finish while the kernel still spins, the case does not wait for the
device (`free`); if not, the flag is released and the case reports how long
it was held (`held`). A control case, `cuda-free` (cudaMalloc + cudaFree),
must be held: it shows that the method sees a call that synchronizes.

Measured on one H200 (docs/gpu/l1-1gpu.txt): NCCL's first communicator of
a process is held (its setup loads NCCL's kernels: the "kernels" phase of
NCCL_DEBUG=INFO's init timings), later ones are not.

usage: python3 l1_one_gpu.py [--hold SECONDS]     # every case, a table
       python3 l1_one_gpu.py --case NAME --hold S # one case (the child)
"""
import argparse
import os
import subprocess
import sys
import threading
import time

CASES = {
    "cuda-free": "control: cudaMalloc then cudaFree (synchronizes the device)",
    "unique-id": "ncclGetUniqueId alone",
    "nccl-init": "ncclGetUniqueId + ncclCommInitRank of a 1-rank communicator",
    "nccl-init-group": "the same, then a group {send to self, recv from self} of 4 bytes on a new stream, synchronized",
    "second-init": "as nccl-init, in a process whose first communicator was made (and used) before the kernel started",
    "second-init-group": "as nccl-init-group, in a process whose first communicator was made (and used) before the kernel started",
    "second-init-unused": "as nccl-init-group, in a process whose first communicator was made (never used) before the kernel started",
}

# Cases that only NCCL's first communicator of a process fails are reported,
# not judged: duplex makes its world communicator before any user code.
FIRST_IN_PROCESS = ("nccl-init", "nccl-init-group")

SPIN = r"""
extern "C" __global__ void spin(volatile int* flag) {
    while (*flag == 0) { __nanosleep(1000); }
}
"""


def child(case, hold):
    import cupy as cp
    import numpy as np
    from cupy.cuda import nccl

    cp.cuda.Device(0).use()

    def self_exchange(comm):
        s = cp.cuda.Stream(non_blocking=True)
        buf = cp.zeros(2, dtype=cp.float32)
        nccl.groupStart()
        comm.send(buf.data.ptr, 1, nccl.NCCL_FLOAT32, 0, s.ptr)
        comm.recv(buf.data.ptr + 4, 1, nccl.NCCL_FLOAT32, 0, s.ptr)
        nccl.groupEnd()
        s.synchronize()

    if case.startswith("second-"):
        # As duplex does: the world communicator exists (and NCCL's kernels
        # are loaded) before any user code runs.
        first = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        if case != "second-init-unused":
            self_exchange(first)
    # Warm CUDA and NVRTC before the clock starts.
    kernel = cp.RawKernel(SPIN, "spin")
    pinned = cp.cuda.alloc_pinned_memory(4)
    flag = np.frombuffer(pinned, np.int32, 1)
    flag[0] = 1
    spin_stream = cp.cuda.Stream(non_blocking=True)
    kernel((1,), (1,), (pinned.ptr,), stream=spin_stream)
    spin_stream.synchronize()
    flag[0] = 0
    kernel((1,), (1,), (pinned.ptr,), stream=spin_stream)
    time.sleep(0.2)
    if spin_stream.done:
        print("RESULT error the spinning kernel did not spin")
        return
    done = threading.Event()
    error = []

    def calls():
        try:
            if case == "cuda-free":
                p = cp.cuda.runtime.malloc(1 << 20)
                cp.cuda.runtime.free(p)
            elif case == "unique-id":
                nccl.get_unique_id()
            else:
                uid = nccl.get_unique_id()
                print("MARK unique id made", flush=True)
                comm = nccl.NcclCommunicator(1, uid, 0)
                print("MARK communicator made", flush=True)
                if case.endswith("-group") or case == "second-init-unused":
                    self_exchange(comm)
        except Exception as e:  # reported, never swallowed
            error.append(repr(e))
        done.set()

    start = time.time()
    threading.Thread(target=calls, daemon=True).start()
    finished = done.wait(hold)
    took = time.time() - start
    spinning = not spin_stream.done
    print(f"MARK release at {took:.3f} s", flush=True)
    flag[0] = 1
    if finished:
        if error:
            print(f"RESULT error {error}")
        elif spinning:
            print(f"RESULT free {took:.3f} s, while the kernel spun")
        else:
            print("RESULT error the kernel stopped spinning by itself")
        spin_stream.synchronize()
        return
    if not done.wait(hold):
        print(f"RESULT stuck still not done {hold:.0f} s after the release")
        os._exit(0)
    held = time.time() - start
    print(f"RESULT held {held:.3f} s: done only after the kernel was released at {hold:.1f} s"
          + (f" ({error})" if error else ""))
    spin_stream.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case")
    ap.add_argument("--hold", type=float, default=5.0)
    ap.add_argument("--verbose", action="store_true", help="print each child's output")
    a = ap.parse_args()
    if a.case:
        child(a.case, a.hold)
        return 0
    bad = 0
    print("| case | what | result |\n|---|---|---|")
    for name, what in CASES.items():
        try:
            out = subprocess.run([sys.executable, __file__, "--case", name, "--hold", str(a.hold)],
                                 capture_output=True, text=True, timeout=4 * a.hold + 60)
            line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")),
                        f"RESULT error no result (exit {out.returncode}): {out.stderr.strip()[-300:]}")
        except subprocess.TimeoutExpired:
            line, out = "RESULT error the child timed out", None
        result = line[len("RESULT "):]
        if a.verbose and out is not None:
            print(f"--- {name}\n{out.stdout}{out.stderr}---", file=sys.stderr)
        expected = "held" if name == "cuda-free" else "free"
        ok = result.startswith(expected)
        judged = name not in FIRST_IN_PROCESS
        bad += judged and not ok
        mark = "" if ok else ("**unexpected** " if judged else "(not judged) ")
        print(f"| {name} | {what} | {mark}{result} |", flush=True)
    judged = [c for c in CASES if c not in FIRST_IN_PROCESS]
    print(f"\n{len(judged) - bad} of {len(judged)} judged cases as L1 needs (the control held, "
          "a later communicator's setup free)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
