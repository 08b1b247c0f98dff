"""What copy-engine lanes across processes would cost (issue 12, item 4):
CUDA IPC between two processes, measured before anything is built on it.

Two processes, A (GPU 0) and B (GPU 1, or GPU 0 with --one-gpu), each
allocate with cudaMalloc (no pool: an IPC handle names a whole
allocation) and exchange handles through a pipe. Measured, each the median
[min-max] of its trials:

  mem-open     cudaIpcOpenMemHandle of one of A's allocations in B (64 MiB
               each, a fresh allocation per trial), and its close
  event-open   cudaIpcOpenEventHandle of one of A's interprocess events
  one-way      B copies 256 MiB from A's buffer (opened by IPC) into its
               own, on its own stream (cudaMemcpyAsync, peer copy)
  both-ways    A and B each copy 256 MiB from the other's buffer at once
               (started together at a barrier), each direction's GB/s
  4KiB         B copies 4 KiB from A's buffer and synchronizes, microseconds

These decide the design: if opening a handle costs much more than moving a
message, buffers must come from an arena opened once per peer, not be
opened per message. Prints a markdown table; every wait has a deadline and
the processes are killed past it.

usage: python3 ipc_probe.py [--one-gpu] [--trials N]
"""
import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

MIB = 1 << 20
BIG = 256 * MIB
HANDLES = 64 * MIB
EVENT_FLAGS = 2 | 4  # cudaEventDisableTiming | cudaEventInterprocess


def spread(xs, fmt="{:.1f}"):
    if not xs:
        return "-"
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"


def worker(role, device, conn, barrier, trials):
    """One process: A exports, B imports; both copy in `both-ways`."""
    import cupy as cp
    rt = cp.cuda.runtime
    cp.cuda.Device(device).use()
    stream = cp.cuda.Stream(non_blocking=True)
    out = {}

    def copy_gbps(dst, src, n):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        rt.memcpyAsync(dst, src, n, rt.memcpyDefault, stream.ptr)
        end.record(stream)
        end.synchronize()
        return n / (cp.cuda.get_elapsed_time(start, end) / 1e3) / 1e9

    if role == "A":
        # Allocations for the open/close trials, and interprocess events.
        allocs = [rt.malloc(HANDLES) for _ in range(trials)]
        conn.send([rt.ipcGetMemHandle(p) for p in allocs])
        events = [rt.eventCreateWithFlags(EVENT_FLAGS) for _ in range(trials)]
        conn.send([rt.ipcGetEventHandle(e) for e in events])
    else:
        handles = conn.recv()
        opens, closes = [], []
        for h in handles:
            t0 = time.perf_counter()
            p = rt.ipcOpenMemHandle(h)
            t1 = time.perf_counter()
            rt.ipcCloseMemHandle(p)
            t2 = time.perf_counter()
            opens.append((t1 - t0) * 1e6)
            closes.append((t2 - t1) * 1e6)
        out["mem-open us"] = opens
        out["mem-close us"] = closes
        ev_opens = []
        for h in conn.recv():
            t0 = time.perf_counter()
            e = rt.ipcOpenEventHandle(h)
            ev_opens.append((time.perf_counter() - t0) * 1e6)
            rt.eventDestroy(e)
        out["event-open us"] = ev_opens
    # The 256 MiB buffers, each side's exported to the other.
    src, dst = rt.malloc(BIG), rt.malloc(BIG)
    rt.memset(src, 1, BIG)
    conn.send(rt.ipcGetMemHandle(src))
    theirs = rt.ipcOpenMemHandle(conn.recv())
    barrier.wait(60)
    if role == "B":
        copy_gbps(dst, theirs, BIG)  # warm-up
        out["one-way GB/s"] = [copy_gbps(dst, theirs, BIG) for _ in range(trials)]
        lat = []
        for _ in range(trials * 4):
            t0 = time.perf_counter()
            rt.memcpyAsync(dst, theirs, 4096, rt.memcpyDefault, stream.ptr)
            stream.synchronize()
            lat.append((time.perf_counter() - t0) * 1e6)
        out["4KiB copy us"] = lat
    barrier.wait(120)
    both = []
    for _ in range(trials):
        barrier.wait(60)
        both.append(copy_gbps(dst, theirs, BIG))
    out["both-ways GB/s (" + role + ")"] = both
    barrier.wait(60)
    rt.ipcCloseMemHandle(theirs)
    # Neither side frees (or exits) while the other still has its memory
    # open.
    barrier.wait(60)
    rt.free(src)
    rt.free(dst)
    if role == "A":
        for p in allocs:
            rt.free(p)
        for e in events:
            rt.eventDestroy(e)
    conn.send(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one-gpu", action="store_true", help="both processes on GPU 0")
    ap.add_argument("--trials", type=int, default=7)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    (a_end, a_child), (b_end, b_child) = ctx.Pipe(), ctx.Pipe()
    devices = (0, 0) if a.one_gpu else (0, 1)
    procs = [ctx.Process(target=worker, args=("A", devices[0], a_child, barrier, a.trials)),
             ctx.Process(target=worker, args=("B", devices[1], b_child, barrier, a.trials))]
    for p in procs:
        p.start()
    deadline = time.time() + 240

    def recv(end, proc):
        """The next message from `proc`; exits (killing both) if it died
        without sending one, or past the deadline."""
        while not end.poll(0.1):
            if time.time() > deadline or not proc.is_alive():
                if end.poll(0):
                    break
                for p in procs:
                    p.kill()
                sys.exit("ipc_probe: a process died or the probe passed its deadline")
        return end.recv()

    pa, pb = procs
    # A's handles go to B; then each side's 256 MiB handle to the other.
    b_end.send(recv(a_end, pa))
    b_end.send(recv(a_end, pa))
    ha, hb = recv(a_end, pa), recv(b_end, pb)
    a_end.send(hb)
    b_end.send(ha)
    results = {}
    results.update(recv(a_end, pa))
    results.update(recv(b_end, pb))
    for p in procs:
        p.join(10)
    where = "one GPU, two processes" if a.one_gpu else "GPU 0 and GPU 1, a process each"
    print(f"### CUDA IPC between two processes ({where}), {a.trials} trials\n")
    print("| figure | median [min-max] |\n|---|---|")
    for k in sorted(results):
        print(f"| {k} | {spread(results[k])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
