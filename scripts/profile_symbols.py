#!/usr/bin/env python3
"""Names the samples of examples/overhead's --profile (sampler.rs).

    scripts/profile_symbols.py SAMPLES BINARY [--top N] [--lines PREFIX]

SAMPLES: one sample per line (hex return addresses, leaf first), then
`# maps` and the process's /proc/self/maps. BINARY: the executable that ran,
or the same build before its line tables were stripped (they name the
functions, through `addr2line`); its samples are those in the process's
executable (its first mapped file that is neither a device nor a library).
Prints the functions by self samples (the leaf) and by inclusive samples
(anywhere in the stack, once per sample), and the most common leaf-to-caller
paths inside the binary. With `--lines PREFIX` (the source root the
binary was built from, e.g. /work/main/): the samples by source line of the
project instead, inlined frames resolved, a library's leaf counted for the
line of the binary that called it."""
import collections
import os
import subprocess
import sys


def load(path):
    samples, maps, in_maps = [], [], False
    for line in open(path):
        line = line.rstrip("\n")
        if line == "# maps":
            in_maps = True
            continue
        if in_maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 5:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            maps.append((lo, hi, int(parts[2], 16), parts[5] if len(parts) > 5 else ""))
        elif line:
            samples.append([int(a, 16) for a in line.split()])
    return samples, maps


def mapping(maps, a):
    """The mapping that holds address `a`, or None."""
    return next((m for m in maps if m[0] <= a < m[1]), None)


def executable(maps, binary):
    """The executable's file name (the first mapped file that is not a
    device or a shared library; else BINARY's) and the base that turns its
    addresses into file addresses (None when it is not mapped)."""
    exe = [
        m[3] for m in maps
        if m[3].startswith("/") and not m[3].startswith("/dev/") and ".so" not in os.path.basename(m[3])
    ]
    name = os.path.basename(exe[0]) if exe else os.path.basename(binary)
    mine = [x for x in maps if os.path.basename(x[3]) == name]
    return name, (min(x[0] - x[2] for x in mine) if mine else None)


def report(path, binary, top=25):
    """The report of the samples in `path` (see the module's docs), as text."""
    samples, maps = load(path)
    name, base = executable(maps, binary)
    # Each address: ("bin", address in the file) or ("lib", library name).
    where = {}
    for s in samples:
        for i, a in enumerate(s):
            # A return address points after its call: name the call.
            q = a if i == 0 else a - 1
            if q in where:
                continue
            m = mapping(maps, q)
            if m is None:
                where[q] = ("lib", "?")
            elif os.path.basename(m[3]) == name:
                where[q] = ("bin", q - base)
            else:
                where[q] = ("lib", os.path.basename(m[3]) or "[anon]")
    in_bin = sorted({v[1] for v in where.values() if v[0] == "bin"})
    names = {}
    if in_bin:
        out = subprocess.run(
            ["addr2line", "-f", "-C", "-e", binary] + [hex(a) for a in in_bin],
            capture_output=True, text=True, check=True,
        ).stdout.splitlines()
        for a, f in zip(in_bin, out[0::2]):
            names[a] = f

    def label(q):
        kind, v = where[q]
        return names.get(v, "?") if kind == "bin" else "[" + v + "]"

    self_count, incl = collections.Counter(), collections.Counter()
    paths = collections.Counter()
    for s in samples:
        frames = [label(a if i == 0 else a - 1) for i, a in enumerate(s)]
        self_count[frames[0]] += 1
        for f in set(frames):
            incl[f] += 1
        paths[" <- ".join(frames[:4])] += 1
    n = max(len(samples), 1)
    lines = [f"{len(samples)} samples"]
    for title, c in (("self", self_count), ("inclusive", incl), ("paths (leaf <- callers)", paths)):
        lines.append(f"\n## {title}")
        for f, k in c.most_common(top):
            lines.append(f"{100 * k / n:6.1f}%  {f}")
    return "\n".join(lines)


def parse_chains(lines):
    """`addr2line -a -i -f` output: {address: [(function, file:line), ...]},
    innermost inlined frame first."""
    chains, cur, i = {}, None, 0
    while i < len(lines):
        if lines[i].startswith("0x"):
            cur = int(lines[i], 16)
            chains[cur] = []
            i += 1
            continue
        if cur is not None and i + 1 < len(lines):
            chains[cur].append((lines[i], lines[i + 1]))
        i += 2
    return chains


def attribute(counts, chains, prefix):
    """Counts by the innermost frame of each address whose file starts with
    `prefix` (the project's own source), else its innermost frame.
    `counts`: {(address, tag): n}; the tag (a library's name, or None for a
    leaf in the binary) is put before the line."""
    out = collections.Counter()
    for (a, tag), n in counts.items():
        chain = chains.get(a, [])
        own = [loc for _, loc in chain if loc.startswith(prefix)]
        loc = own[0] if own else (chain[0][1] if chain else "?")
        if loc.startswith(prefix):
            loc = loc[len(prefix):]
        out[("[" + tag + "] from " if tag else "") + loc] += n
    return out


def lines_report(path, binary, prefix, top=40):
    """Samples by source line: a leaf in the binary counts for the line of
    the project's source that it is inlined into; a leaf in a library whose
    caller is in the binary counts for the calling line (allocations,
    locks, copies that the binary asks libc for)."""
    samples, maps = load(path)
    name, base = executable(maps, binary)
    if base is None:
        return f"{len(samples)} samples, none in {name}"
    counts = collections.Counter()
    for s in samples:
        m = mapping(maps, s[0])
        if m is not None and os.path.basename(m[3]) == name:
            counts[(s[0] - base, None)] += 1
        elif m is not None and len(s) > 1:
            c = mapping(maps, s[1] - 1)
            if c is not None and os.path.basename(c[3]) == name:
                counts[(s[1] - 1 - base, os.path.basename(m[3]) or "[anon]")] += 1
    addrs = sorted({a for a, _ in counts})
    out = subprocess.run(
        ["addr2line", "-a", "-i", "-f", "-C", "-e", binary] + [hex(a) for a in addrs],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    by_line = attribute(counts, parse_chains(out), prefix)
    n = max(len(samples), 1)
    lines = [f"{len(samples)} samples; by line of {prefix}"]
    for k, c in by_line.most_common(top):
        lines.append(f"{100 * c / n:6.2f}%  {k}")
    return "\n".join(lines)


def main():
    args = sys.argv[1:]
    top = 25
    if "--top" in args:
        i = args.index("--top")
        top = int(args[i + 1])
        del args[i : i + 2]
    prefix = None
    if "--lines" in args:
        i = args.index("--lines")
        prefix = args[i + 1]
        del args[i : i + 2]
    if len(args) != 2:
        sys.exit(__doc__)
    if prefix is not None:
        print(lines_report(args[0], args[1], prefix, top))
    else:
        print(report(args[0], args[1], top))


if __name__ == "__main__":
    main()
