#!/usr/bin/env python3
"""Names the samples of examples/overhead's --profile (sampler.rs).

    scripts/profile_symbols.py SAMPLES BINARY [--top N]

SAMPLES: one sample per line (hex return addresses, leaf first), then
`# maps` and the process's /proc/self/maps. BINARY: the executable that ran,
or the same build before its line tables were stripped (they name the
functions, through `addr2line`); its samples are those in the process's
executable (its first mapped file that is neither a device nor a library).
Prints the functions by self samples (the leaf) and by inclusive samples
(anywhere in the stack, once per sample), and the most common leaf-to-caller
paths inside the binary."""
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


def report(path, binary, top=25):
    """The report of the samples in `path` (see the module's docs), as text."""
    samples, maps = load(path)
    # The executable: the first mapped file that is not a device or a
    # shared library.
    exe = [
        m[3] for m in maps
        if m[3].startswith("/") and not m[3].startswith("/dev/") and ".so" not in os.path.basename(m[3])
    ]
    name = os.path.basename(exe[0]) if exe else os.path.basename(binary)
    # Each address: ("bin", address in the file) or ("lib", library name).
    where = {}
    for s in samples:
        for i, a in enumerate(s):
            # A return address points after its call: name the call.
            q = a if i == 0 else a - 1
            if q in where:
                continue
            m = next((m for m in maps if m[0] <= q < m[1]), None)
            if m is None:
                where[q] = ("lib", "?")
            elif os.path.basename(m[3]) == name:
                base = min(x[0] - x[2] for x in maps if os.path.basename(x[3]) == name)
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


def main():
    args = sys.argv[1:]
    top = 25
    if "--top" in args:
        i = args.index("--top")
        top = int(args[i + 1])
        del args[i : i + 2]
    if len(args) != 2:
        sys.exit(__doc__)
    print(report(args[0], args[1], top))


if __name__ == "__main__":
    main()
