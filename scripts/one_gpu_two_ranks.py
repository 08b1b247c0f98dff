"""Can two processes on one GPU form an NCCL communicator? NCCL refuses two
ranks on one GPU of one host ("Duplicate GPU detected"); with a different
NCCL_HOSTID per process, each rank is taken to be on a host of its own and
the two talk over sockets (the loopback interface). If so, duplex's
process-per-rank jobs (hangs, faults, lanes made on first use) can run on a
machine with one GPU: their behaviour, not their speed.

usage: python3 one_gpu_two_ranks.py
Prints what each rank saw; exits 0 when both ranks' bytes arrived.
"""
import multiprocessing as mp
import os
import sys
import time


def rank_main(rank, conn, env):
    os.environ.update(env)
    import cupy as cp
    from cupy.cuda import nccl
    cp.cuda.Device(0).use()
    if rank == 0:
        uid = nccl.get_unique_id()
        conn.send(uid)
    else:
        uid = conn.recv()
    t0 = time.time()
    comm = nccl.NcclCommunicator(2, uid, rank)
    made = time.time() - t0
    n = 1 << 20
    out = cp.full(n, rank + 1, dtype=cp.float32)
    inb = cp.zeros(n, dtype=cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    peer = 1 - rank
    t0 = time.time()
    nccl.groupStart()
    comm.send(out.data.ptr, n, nccl.NCCL_FLOAT32, peer, stream.ptr)
    comm.recv(inb.data.ptr, n, nccl.NCCL_FLOAT32, peer, stream.ptr)
    nccl.groupEnd()
    stream.synchronize()
    ok = bool((inb == peer + 1).all())
    conn.send((rank, made, time.time() - t0, ok))
    comm.destroy()


def main():
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    base = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN")}
    procs = [ctx.Process(target=rank_main,
                         args=(r, pipes[r][1], dict(base, NCCL_HOSTID=f"duplex-one-gpu-rank-{r}")))
             for r in range(2)]
    for p in procs:
        p.start()
    pipes[1][0].send(pipes[0][0].recv())  # the unique id, rank 0 -> rank 1
    results, deadline = [], time.time() + 90
    for end, _ in pipes:
        while not end.poll(0.1):
            if time.time() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                sys.exit("one_gpu_two_ranks: a rank died or passed the deadline")
        results.append(end.recv())
    for p in procs:
        p.join(20)
    for rank, made, moved, ok in results:
        print(f"rank {rank}: communicator made in {made:.2f} s; 4 MiB each way in {moved * 1e3:.1f} ms; bytes arrived: {ok}")
    return 0 if all(r[3] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
