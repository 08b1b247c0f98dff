"""PyTorch's point-to-point figures on the same two GPUs, for BENCHMARKS.md.

usage: python3 bench_torch.py OUT.json
Measures, with torch.distributed (NCCL backend), two processes:
  one_way     dist.send / dist.recv, rank 0 -> rank 1
  batch       both directions at once with batch_isend_irecv (one group)
  two_pgs     both directions at once, one process group per direction
  latency_us  4 KiB ping-pong on one process group, half the round trip
Timing is host wall-clock around many back-to-back ops and a synchronize,
as in duplex's bench, after a warm-up.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [1 << 20, 64 << 20, 256 << 20]


def iters(b):
    return 20 if b >= 256 << 20 else 50 if b >= 64 << 20 else 400


def worker(rank, world, out_path, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    pg_a = dist.new_group([0, 1])  # 0 -> 1
    pg_b = dist.new_group([0, 1])  # 1 -> 0
    peer = 1 - rank
    res = {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
           "one_way": [], "batch": [], "two_pgs": []}

    def timed(fn, n):
        fn(3)
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        fn(n)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    for b in SIZES:
        n = iters(b)
        x = torch.empty(b, dtype=torch.uint8, device=dev)
        y = torch.empty(b, dtype=torch.uint8, device=dev)

        def one(k):
            for _ in range(k):
                if rank == 0:
                    dist.send(x, 1)
                else:
                    dist.recv(y, 0)
        d = timed(one, n)
        res["one_way"].append([b, b * n / d / 1e9])

        def batch(k):
            for _ in range(k):
                ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]
                for r in dist.batch_isend_irecv(ops):
                    r.wait()
        d = timed(batch, n)
        res["batch"].append([b, b * n / d / 1e9])

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
        res["two_pgs"].append([b, b * n / d / 1e9])

    x = torch.empty(4096, dtype=torch.uint8, device=dev)
    y = torch.empty(4096, dtype=torch.uint8, device=dev)

    def pingpong(k):
        for _ in range(k):
            if rank == 0:
                dist.send(x, 1)
                dist.recv(y, 1)
            else:
                dist.recv(y, 0)
                dist.send(x, 0)
    n = 2000
    d = min(timed(pingpong, n), timed(pingpong, n))
    res["latency_us"] = d * 1e6 / n / 2
    if rank == 1:
        with open(out_path, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "bench-torch.json"
    mp.spawn(worker, args=(2, out, 29517), nprocs=2, join=True)
    print(open(out).read())
