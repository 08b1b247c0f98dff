"""PyTorch's point-to-point figures on the same two GPUs, for BENCHMARKS.md.

usage: python3 bench_torch.py [OUT.json] [--trials N]
Measures, with torch.distributed (NCCL backend), two processes:
  one_way     dist.send / dist.recv, rank 0 -> rank 1
  batch       both directions at once with batch_isend_irecv (one group)
  two_pgs     both directions at once, one process group per direction
  latency_us  4 KiB ping-pong on one process group, half the round trip
Timing is host wall-clock around many back-to-back ops and a synchronize,
as in duplex's bench, after a warm-up (3 ops, or 3 round trips), on rank
1's clock.

Every figure is taken in N trials (default 5), interleaved: trial k
measures every figure once before trial k+1 starts. The JSON (format 2, as
duplex's bench writes) holds for each figure its unit, which way is better,
every trial's value, and their median, min and max.
"""
import argparse
import json
import os
import statistics
import time

SIZES = [1 << 20, 64 << 20, 256 << 20]


def iters(b):
    return 20 if b >= 256 << 20 else 50 if b >= 64 << 20 else 400


def size_name(b):
    """A size as duplex prints it (duplex::Size): 1MiB, 64MiB, 4KiB."""
    for name, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b and b % scale == 0:
            return f"{b // scale}{name}"
    return f"{b}B"


def figure(unit, better, trials, nbytes=None):
    f = {"unit": unit, "better": better, "trials": trials,
         "median": statistics.median(trials), "min": min(trials), "max": max(trials)}
    if nbytes is not None:
        f["bytes"] = nbytes
    return f


def worker(rank, world, out_path, port, trials):
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    pg_a = dist.new_group([0, 1])  # 0 -> 1
    pg_b = dist.new_group([0, 1])  # 1 -> 0
    peer = 1 - rank
    samples = {}  # figure name -> (unit, better, bytes, [values])

    def push(name, unit, better, value, nbytes=None):
        samples.setdefault(name, (unit, better, nbytes, []))[3].append(value)

    def timed(fn, n):
        fn(3)
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        fn(n)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    bufs = {b: (torch.empty(b, dtype=torch.uint8, device=dev),
                torch.empty(b, dtype=torch.uint8, device=dev)) for b in SIZES}
    small = (torch.empty(4096, dtype=torch.uint8, device=dev),
             torch.empty(4096, dtype=torch.uint8, device=dev))

    for trial in range(trials):
        if rank == 1:
            print(f"torch: trial {trial + 1} of {trials}", flush=True)
        for b in SIZES:
            n = iters(b)
            x, y = bufs[b]

            def one(k):
                for _ in range(k):
                    if rank == 0:
                        dist.send(x, 1)
                    else:
                        dist.recv(y, 0)
            d = timed(one, n)
            push(f"one_way/{size_name(b)}", "GB/s", "higher", b * n / d / 1e9, b)

            def batch(k):
                for _ in range(k):
                    ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]
                    for r in dist.batch_isend_irecv(ops):
                        r.wait()
            d = timed(batch, n)
            push(f"batch/{size_name(b)}", "GB/s", "higher", b * n / d / 1e9, b)

            def two(k):
                for _ in range(k):
                    if rank == 0:
                        s = dist.isend(x, 1, group=pg_a)
                        r = dist.irecv(y, 1, group=pg_b)
                    else:
                        r = dist.irecv(y, 0, group=pg_a)
                        s = dist.isend(x, 0, group=pg_b)
                    s.wait()
                    r.wait()
            d = timed(two, n)
            push(f"two_pgs/{size_name(b)}", "GB/s", "higher", b * n / d / 1e9, b)

        x, y = small

        def pingpong(k):
            for _ in range(k):
                if rank == 0:
                    dist.send(x, 1)
                    dist.recv(y, 1)
                else:
                    dist.recv(y, 0)
                    dist.send(x, 0)
        n = 2000
        push("latency_us", "us", "lower", timed(pingpong, n) * 1e6 / n / 2)

    if rank == 1:
        res = {"format": 2, "bench": "torch", "torch": torch.__version__,
               "nccl": ".".join(map(str, torch.cuda.nccl.version())), "trials": trials,
               "figures": {k: figure(u, bt, v, nb) for k, (u, bt, nb, v) in sorted(samples.items())}}
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default="bench-torch.json")
    p.add_argument("--trials", type=int, default=5)
    a = p.parse_args()
    if a.trials < 1:
        p.error("--trials takes a positive number")
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(2, os.path.abspath(a.out), 29517, a.trials), nprocs=2, join=True)
    print(open(a.out).read())


if __name__ == "__main__":
    main()
