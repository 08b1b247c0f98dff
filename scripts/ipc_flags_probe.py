"""Checks, on the GPUs, the mechanisms a copy-engine lane across processes
would be built on (issue 12, item 4), before anything is built on them.

A copy-engine lane in one process (`backend-nccl/src/copy.rs`) blocks each
side's stream on a flag slot in pinned host memory (`cuStreamWaitValue32`)
and releases both with a write from the lane's copy stream
(`cuStreamWriteValue32`) after the copy; an abort writes the slots from the
host. Across processes the same protocol needs, and this probe checks with
two processes, A (the sender, GPU 0) and B (the receiver, GPU 1, or GPU 0
with --one-gpu), each registering one POSIX shared-memory segment
(`cuMemHostRegister`, device-mapped) that holds the flag slots:

  X1 flag-release    B's stream waits on a slot; A's stream writes it
                     (cuStreamWriteValue32 through A's own mapping): B's
                     stream goes on. Also: it does not go on before.
  X2 host-release    the same wait, released by a plain store from A's host
                     (an abort from the surviving side).
  X3 event-wait      B's stream waits (cuStreamWaitEvent) on A's
                     interprocess event, recorded on A's stream behind a
                     blocked wait: B does not go on until A's stream does.
                     Meanwhile another stream of A goes on (no false
                     dependency), and A records the same event again on
                     that free stream: whether that record completes while
                     the earlier one is held (SEEN: a fact reported, not a
                     check) decides when a pool of such events may be
                     reused; and it completes once the earlier one has.
  X4 message         the whole protocol for one message: A records a ready
                     event and waits on slot k; B's copy stream waits for
                     A's ready event and its own, copies from A's buffer
                     (opened by IPC) into its own, and writes slot k; both
                     streams go on, and every byte arrived. Timed for 4 KiB
                     (microseconds from B's enqueue to A's stream released,
                     seen by A) and 256 MiB (GB/s).

Prints one line per check (PASS/FAIL and what was seen; SEEN for the
re-record, a question rather than a requirement) and a markdown table of the
timings; exits 1 when a check fails. Every wait has a deadline and
the processes are killed past it.

usage: python3 ipc_flags_probe.py [--one-gpu] [--trials N]
"""
import argparse
import ctypes
import multiprocessing as mp
import sys
import time

from ipc_probe import spread  # the same median [min-max] as the IPC cost probe

MIB = 1 << 20
BIG = 256 * MIB
SMALL = 4096
SLOTS = 64
CU_MEMHOSTREGISTER_PORTABLE = 0x1
CU_MEMHOSTREGISTER_DEVICEMAP = 0x2
CU_STREAM_WAIT_VALUE_GEQ = 0x0
EVENT_FLAGS = 2 | 4  # cudaEventDisableTiming | cudaEventInterprocess
CUDA_ERROR_NOT_READY = 600


class Driver:
    """The few CUDA driver calls cupy does not wrap."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def call(self, name, *args):
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed: CUresult {rc}")

    def register(self, addr, size):
        self.call("cuMemHostRegister_v2", ctypes.c_void_p(addr), ctypes.c_size_t(size),
                  ctypes.c_uint(CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP))
        dptr = ctypes.c_uint64()
        self.call("cuMemHostGetDevicePointer_v2", ctypes.byref(dptr), ctypes.c_void_p(addr), ctypes.c_uint(0))
        return dptr.value

    def unregister(self, addr):
        self.call("cuMemHostUnregister", ctypes.c_void_p(addr))

    def wait_value(self, stream, dptr, value):
        self.call("cuStreamWaitValue32_v2", ctypes.c_void_p(stream), ctypes.c_uint64(dptr),
                  ctypes.c_uint32(value), ctypes.c_uint(CU_STREAM_WAIT_VALUE_GEQ))

    def write_value(self, stream, dptr, value):
        self.call("cuStreamWriteValue32_v2", ctypes.c_void_p(stream), ctypes.c_uint64(dptr),
                  ctypes.c_uint32(value), ctypes.c_uint(0))


def worker(role, device, shm_name, conn, barrier, trials):
    """A (sender) or B (receiver); sends back {"checks": [...], "times": {...}}."""
    from multiprocessing import shared_memory
    import cupy as cp
    rt = cp.cuda.runtime
    cp.cuda.Device(device).use()
    rt.free(0)  # makes the device's primary context current, for the driver calls
    drv = Driver()
    shm = shared_memory.SharedMemory(name=shm_name)
    flags = (ctypes.c_uint32 * SLOTS).from_buffer(shm.buf)
    base = ctypes.addressof(flags)
    dflags = drv.register(base, shm.size)
    slot = lambda i: dflags + 4 * i  # noqa: E731
    stream = cp.cuda.Stream(non_blocking=True)
    copy_stream = cp.cuda.Stream(non_blocking=True)
    checks, times = [], {}

    def check(name, ok, seen, required=True):
        """A check (PASS/FAIL), or, not `required`, a fact seen (SEEN)."""
        verdict = "PASS" if ok else "FAIL"
        if not required:
            ok, verdict = True, "SEEN"
        checks.append((name, bool(ok), f"{verdict} {name}: {seen}"))
        print(f"[{role}] {verdict} {name}: {seen}", file=sys.stderr, flush=True)

    def done(event):
        try:
            # cupy returns cudaErrorNotReady (600) rather than raising it.
            return rt.eventQuery(event) == 0
        except cp.cuda.runtime.CUDARuntimeError as e:
            if e.status == CUDA_ERROR_NOT_READY:
                return False
            raise

    def wait_done(event, seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            if done(event):
                return True
        return False

    def marker(s):
        e = rt.eventCreateWithFlags(2)
        rt.eventRecord(e, s.ptr)
        return e

    def settle(s, what):
        """Waits (bounded) for everything enqueued on `s` so far."""
        if not wait_done(marker(s), 10):
            check("streams drain", False, f"{what}: not done within 10 s")

    def held_until_released(name, i, release, by):
        """B's stream waits on slot `i`; A, once B has looked, runs
        `release`. Checks that B is held before and goes on after."""
        barrier.wait(60)
        if role == "B":
            drv.wait_value(stream.ptr, slot(i), 1)
            e = marker(stream)
            barrier.wait(60)
            time.sleep(0.2)
            early = done(e)
            barrier.wait(60)  # A releases now
            t0 = time.perf_counter()
            released = wait_done(e, 5)
            check(name, released and not early,
                  f"not before {by}: {not early}; after it: {released} in {(time.perf_counter() - t0) * 1e6:.0f} us")
        else:
            barrier.wait(60)
            barrier.wait(60)
            release()

    def write_from_stream():
        drv.write_value(stream.ptr, slot(0), 1)
        settle(stream, "X1's write")

    def store_from_host():
        flags[1] = 1

    # X1: B waits on slot 0; A's stream writes it. X2: the same, released
    # by a store from A's host.
    held_until_released("X1 flag-release", 0, write_from_stream, "the write")
    held_until_released("X2 host-release", 1, store_from_host, "the store")

    # X3: B waits on A's interprocess event, recorded behind a blocked wait
    # on A's stream; A records it again once B enqueued its wait.
    barrier.wait(60)
    if role == "A":
        ev = rt.eventCreateWithFlags(EVENT_FLAGS)
        drv.wait_value(stream.ptr, slot(2), 1)  # held until B's host says
        rt.eventRecord(ev, stream.ptr)
        conn.send(rt.ipcGetEventHandle(ev))
        barrier.wait(60)  # B has enqueued its wait on the event
        # A plain event on another stream of A completes while A's stream
        # is blocked (no false dependency between the two streams).
        free = wait_done(marker(copy_stream), 5)
        check("X3 another stream of A goes on", free, f"within 5 s: {free}")
        # Record the interprocess event again on that stream: does it
        # complete while its earlier record is held?
        rt.eventRecord(ev, copy_stream.ptr)
        again = wait_done(ev, 5)
        check("X3 re-record while the earlier record is held", again,
              f"completed within 5 s: {again} (if not, an event is reused only once its last record completed)",
              required=False)
        barrier.wait(60)
        barrier.wait(60)  # B released A's stream
        later = wait_done(ev, 5)
        check("X3 the re-record completes once the earlier record does", later, f"within 5 s: {later}")
        settle(stream, "X3's stream of A")
    else:
        ev = rt.ipcOpenEventHandle(conn.recv())
        rt.streamWaitEvent(stream.ptr, ev, 0)
        e = marker(stream)
        barrier.wait(60)
        barrier.wait(60)  # A re-recorded the event
        time.sleep(0.2)
        early = done(e)
        flags[2] = 1  # A's stream goes on
        barrier.wait(60)
        released = wait_done(e, 5)
        check("X3 event-wait", released and not early,
              f"held while A's record was: {not early}; after: {released}")
        rt.eventDestroy(ev)

    # X4: whole messages. A exports its source buffers; B its done-ness
    # through the slots.
    barrier.wait(60)
    if role == "A":
        small = cp.arange(SMALL // 4, dtype=cp.uint32)
        big = cp.arange(BIG // 4, dtype=cp.uint32)
        cp.cuda.Device().synchronize()  # written before any ready event
        conn.send((rt.ipcGetMemHandle(small.data.ptr), rt.ipcGetMemHandle(big.data.ptr)))
        ready = rt.eventCreateWithFlags(EVENT_FLAGS)
        conn.send(rt.ipcGetEventHandle(ready))
        lat = []
        k = 3
        for n, reps in ((SMALL, trials * 4), (BIG, trials + 1)):
            for _ in range(reps):
                k += 1
                released = rt.eventCreateWithFlags(2)
                barrier.wait(60)
                rt.eventRecord(ready, stream.ptr)
                drv.wait_value(stream.ptr, slot(k % SLOTS), k)
                rt.eventRecord(released, stream.ptr)
                conn.send(k)  # the descriptor: message k is issued
                if not wait_done(released, 10):
                    # Stays in step with B (its barriers), reporting it.
                    check("X4 message", False, f"A's stream was not released for message {k}")
                t1 = time.perf_counter()
                t0 = conn.recv()  # B enqueued its copy at t0 (perf_counter is system-wide)
                if n == SMALL:
                    lat.append((t1 - t0) * 1e6)
                rt.eventDestroy(released)
        times["4KiB message, B's enqueue to A released, us"] = lat[1:]
        barrier.wait(60)
    else:
        hs, hb = conn.recv()
        theirs = {SMALL: rt.ipcOpenMemHandle(hs), BIG: rt.ipcOpenMemHandle(hb)}
        ready = rt.ipcOpenEventHandle(conn.recv())
        mine = {SMALL: cp.zeros(SMALL // 4, dtype=cp.uint32), BIG: cp.zeros(BIG // 4, dtype=cp.uint32)}
        gbps, ok = [], True
        for n, reps in ((SMALL, trials * 4), (BIG, trials + 1)):
            for i in range(reps):
                barrier.wait(60)
                with stream:
                    mine[n].fill(0)
                k = conn.recv()
                own_ready = marker(stream)
                start, end = cp.cuda.Event(), cp.cuda.Event()
                rt.streamWaitEvent(copy_stream.ptr, ready, 0)
                rt.streamWaitEvent(copy_stream.ptr, own_ready, 0)
                start.record(copy_stream)
                rt.memcpyAsync(mine[n].data.ptr, theirs[n], n, rt.memcpyDefault, copy_stream.ptr)
                end.record(copy_stream)
                drv.write_value(copy_stream.ptr, slot(k % SLOTS), k)
                t0 = time.perf_counter()
                conn.send(t0)
                settle(copy_stream, f"X4's copy of message {k}")
                if n == BIG and i > 0:
                    gbps.append(n / (cp.cuda.get_elapsed_time(start, end) / 1e3) / 1e9)
                good = bool((mine[n] == cp.arange(n // 4, dtype=cp.uint32)).all())
                ok = ok and good
        check("X4 message", ok, f"every byte of {trials * 4} x 4 KiB and {trials + 1} x 256 MiB arrived: {ok}")
        times["256MiB message GB/s"] = gbps
        barrier.wait(60)
        for p in theirs.values():
            rt.ipcCloseMemHandle(p)
    barrier.wait(60)
    settle(stream, "the end")
    settle(copy_stream, "the end")
    drv.unregister(base)
    del flags
    shm.close()
    conn.send({"checks": checks, "times": times})


def main():
    from multiprocessing import shared_memory
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one-gpu", action="store_true", help="both processes on GPU 0")
    ap.add_argument("--trials", type=int, default=7)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    shm = shared_memory.SharedMemory(create=True, size=4096)
    try:
        barrier = ctx.Barrier(2)
        (a_end, a_child), (b_end, b_child) = ctx.Pipe(), ctx.Pipe()
        devices = (0, 0) if a.one_gpu else (0, 1)
        procs = [ctx.Process(target=worker, args=("A", devices[0], shm.name, a_child, barrier, a.trials)),
                 ctx.Process(target=worker, args=("B", devices[1], shm.name, b_child, barrier, a.trials))]
        for p in procs:
            p.start()
        deadline = time.time() + 150

        def give_up(why):
            for p in procs:
                p.kill()
            sys.exit(f"ipc_flags_probe: {why}")

        # Relay: X3's event handle, X4's handles and descriptors (A -> B) and
        # enqueue times (B -> A), until each side sends its result (a dict).
        results = {}
        while len(results) < 2:
            for name, end, other in (("A", a_end, b_end), ("B", b_end, a_end)):
                if name in results or not end.poll(0.001):
                    continue
                msg = end.recv()
                if isinstance(msg, dict):
                    results[name] = msg
                else:
                    other.send(msg)
            if time.time() > deadline:
                give_up("the probe passed its deadline (150 s)")
            for name, end, p in (("A", a_end, procs[0]), ("B", b_end, procs[1])):
                if name not in results and p.exitcode is not None and not end.poll(0):
                    give_up(f"process {name} ended (exit code {p.exitcode}) before sending its result")
        for p in procs:
            p.join(10)
    finally:
        shm.close()
        shm.unlink()
    where = "one GPU, two processes" if a.one_gpu else "GPU 0 and GPU 1, a process each"
    checks = results["A"]["checks"] + results["B"]["checks"]
    print(f"### Copy-lane mechanisms across processes ({where}), {a.trials} trials\n")
    for _, _, line in sorted(checks):
        print(line)
    print("\n| figure | median [min-max] |\n|---|---|")
    for k, v in sorted({**results["A"]["times"], **results["B"]["times"]}.items()):
        print(f"| {k} | {spread(v)} |")
    return 0 if checks and all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
