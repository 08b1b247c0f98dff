"""Merges bench-duplex.json and bench-torch.json into the Markdown table of
BENCHMARKS.md, with the targets of issue 4 checked.

usage: python3 bench_table.py DUPLEX.json TORCH.json
"""
import json
import sys

d = json.load(open(sys.argv[1]))
t = json.load(open(sys.argv[2]))
mib = lambda b: f"{b >> 20} MiB"
tv = lambda k: {b: g for b, g in t[k]}
one_t, batch_t, two_t = tv("one_way"), tv("batch"), tv("two_pgs")
one_d = {b: g for b, g in d["one_way"]}
both_d = {b: g for b, g in d["both_ways"]}
print(f"NCCL {d['nccl']} (duplex, system library) / PyTorch {t['torch']} with NCCL {t['nccl']}; lane CTAs {d['ctas']}\n")
print("| size | duplex one way | PyTorch one way | duplex both ways (each) | PyTorch batch_isend_irecv (each) | PyTorch one PG per direction (each) | duplex / PyTorch best | duplex both / one way |")
print("|---|---|---|---|---|---|---|---|")
for b in sorted(one_d):
    best = max(batch_t.get(b, 0), two_t.get(b, 0))
    print(f"| {mib(b)} | {one_d[b]:.1f} | {one_t.get(b, 0):.1f} | {both_d[b]:.1f} | {batch_t.get(b, 0):.1f} | {two_t.get(b, 0):.1f} | "
          f"{both_d[b] / best if best else 0:.2f}x | {both_d[b] / one_d[b]:.2f}x |")
print("\nGB/s per direction (10^9 bytes/s).\n")
print(f"| 4 KiB latency (half a round trip) | duplex {d['latency_duplex_us']:.2f} us | raw NCCL, same comms and stream {d['latency_raw_us']:.2f} us | PyTorch {t['latency_us']:.2f} us |")
print("|---|---|---|---|")
print(f"\nHost time to enqueue one op: duplex {d['host_duplex_us']:.2f} us, raw ncclSend/ncclRecv {d['host_raw_us']:.2f} us "
      f"(duplex adds {d['host_duplex_us'] - d['host_raw_us']:.2f} us).\n")
b = 256 << 20
best = max(batch_t.get(b, 0), two_t.get(b, 0))
targets = [
    ("256 MiB both ways >= 1.1x PyTorch's best", both_d[b] >= 1.1 * best, f"{both_d[b] / best:.2f}x"),
    ("256 MiB both ways >= 0.95x one way, per direction", both_d[b] >= 0.95 * one_d[b], f"{both_d[b] / one_d[b]:.2f}x"),
    ("4 KiB latency within 2 us of raw NCCL", d["latency_duplex_us"] - d["latency_raw_us"] <= 2.0,
     f"+{d['latency_duplex_us'] - d['latency_raw_us']:.2f} us"),
]
print("| target | met | measured |\n|---|---|---|")
for name, ok, val in targets:
    print(f"| {name} | {'yes' if ok else 'NO'} | {val} |")
