"""Merges duplex's and PyTorch's benchmark JSON into the Markdown tables of
BENCHMARKS.md: every figure as its median with [min–max] of its trials,
duplex and PyTorch side by side, the targets (met or not, with the measured
value), and a comparison with a committed baseline.

usage: python3 bench_table.py DUPLEX.json TORCH.json
           [--baseline FILE]... [--tolerance FRACTION] [--slack FRACTION]
           [--strict] [--min-trials N] [--write-baseline OUT.json]
           [--setting FILE]...
       python3 bench_table.py --settings-only REFERENCE.json [FILE.json]...

DUPLEX.json is what backend-nccl/examples/bench.rs writes, TORCH.json what
scripts/bench_torch.py writes: format 2 (each figure's trials, median, min,
max) or the old format of one value per figure (read as one trial each).

--baseline FILE   a baseline to compare with (repeatable): a file written by
                  --write-baseline, or a run's JSON of either bench, old
                  format included. Without it, no comparison. One that
                  cannot be read is exit status 2 (the tables are still
                  written, with a note that nothing was compared).
--tolerance F     for a baseline figure of one trial, which has no spread:
                  the band is its value ±F (default 0.10, i.e. 10%). Such a
                  figure is still judged, but the report and a
                  `bench_table: warning:` line on stderr say that the
                  baseline has figures of fewer than --min-trials trials and
                  should be replaced (with the command that does it).
--slack F         widens a baseline's [min, max] by F of its median on each
                  side (default 0.05: the band is [min - 5% of the median,
                  max + 5% of the median]; 0 makes it exactly [min, max]).
                  A baseline of one trial uses --tolerance instead.
--strict          needs --baseline (without one it is exit status 2: a
                  strict run that compared nothing would pass); exit 1 when
                  a figure regressed: every trial of this run is worse than
                  the baseline's band, its [min, max] widened by the slack
                  (the new [min, max] and the band do not overlap); when a
                  baseline figure was not measured in this run; when a
                  figure's unit is not the baseline's; when a figure of
                  this run has no baseline (it was never judged; the
                  message gives the command that rewrites the baseline from
                  this run); or when a figure of this run has fewer than
                  --min-trials trials. A median outside the band alone is
                  flagged in the table but does not fail: with 5 trials on
                  each side and no slack it happens by chance about once in
                  12 figures (BENCHMARKS.md, "Why every trial, and why the
                  slack", has the reasoning). Each reason is one stderr
                  line starting `bench_table: strict:`.
--min-trials N    the fewest trials a figure of this run may have under
                  --strict (default 5), and the fewest a baseline figure may
                  have without the warning above.
--write-baseline  writes the figures of DUPLEX.json and TORCH.json as a
                  baseline file (docs/gpu/bench-baseline.json);
                  --baseline-note TEXT says in it which run it is.
--setting FILE    a `bench --quick --no-copy --json FILE` result run under
                  other lane settings (repeatable; `--ctas` is the same):
                  its CTA bounds (`--min-ctas N --max-ctas N`) and the
                  NCCL_* environment it ran with, which bench records. A
                  table at 256 MiB: each setting's lane memory, creation
                  time and bandwidths beside the main run's.

--settings-only   the lane-settings table alone (`scripts/gpu.sh run lanes`):
                  each file a `bench --quick --no-copy` result, the first
                  the reference (NCCL's defaults); each row's NCCL
                  environment is named by what differs from the first's.

Exit status: 0, or 1 under --strict as above, or 2 for a wrong command line
or a baseline that cannot be read. A missing or unreadable run input is a
note in the output (its figures are then not measured), not a crash; so is
a figure that cannot be judged (a trial that is not a finite number, such
as null, which is how serde_json writes a NaN; no trials and no median; a
`better` other than "higher" or "lower"): a note, and the figure counts as
not measured. In a baseline such a figure makes the baseline unreadable
(exit status 2, naming it).
"""
import argparse
import json
import math
import shlex
import statistics
import sys

# The one-trial tolerance and the targets are stated here once; BENCHMARKS.md
# repeats them.
DEFAULT_TOLERANCE = 0.10
# The slack: how far, as a fraction of the baseline's median, the band
# reaches past the baseline's min and max on each side.
DEFAULT_SLACK = 0.05
# The fewest trials a figure is judged on (--min-trials).
DEFAULT_MIN_TRIALS = 5
BASELINE_FORMAT = "duplex-bench-baseline"
# Which way is better for a figure that does not say, by its unit.
UNIT_BETTER = {"GB/s": "higher", "us": "lower", "ms": "lower", "B": "lower"}

SIZES = [1 << 20, 64 << 20, 256 << 20]


def size_name(b):
    """A size as duplex prints it (duplex::Size): 1MiB, 64MiB, 4KiB."""
    for name, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b and b % scale == 0:
            return f"{b // scale}{name}"
    return f"{b}B"


def finite(v):
    """Whether `v` is a finite number (JSON's, so not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def shown(v):
    """A JSON value as a message quotes it (None as null)."""
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


def make_figure(unit, better, trials, nbytes=None):
    """A figure from its trials; ValueError when one is not a finite number
    (serde_json writes a NaN as null)."""
    if not isinstance(trials, list):
        raise ValueError(f"its trials are {shown(trials)}, not a list")
    for i, v in enumerate(trials):
        if not finite(v):
            raise ValueError(f"trial {i + 1} of {len(trials)} is {shown(v)}, not a finite number")
    if not trials:
        raise ValueError("it has no trials")
    if nbytes is not None and (not isinstance(nbytes, int) or isinstance(nbytes, bool)):
        raise ValueError(f"its size in bytes is {shown(nbytes)}, not a whole number")
    trials = [float(v) for v in trials]
    f = {"unit": unit, "better": better, "trials": trials,
         "median": statistics.median(trials), "min": min(trials), "max": max(trials)}
    if nbytes is not None:
        f["bytes"] = nbytes
    return f


def normalize_figure(f):
    """A figure with its summary recomputed from its trials (when it has
    any), so that a hand-edited or truncated file cannot disagree with
    itself. ValueError, saying why, for one that cannot be judged: not an
    object, a trial that is not a finite number (null: serde_json's NaN),
    no trials and no finite median, or a `better` that is neither "higher"
    nor "lower". A figure without `better` takes its unit's (UNIT_BETTER:
    GB/s higher; us, ms, B lower); one whose unit says nothing either
    cannot be judged."""
    if not isinstance(f, dict):
        raise ValueError(f"it is {shown(f)}, not an object")
    unit = f.get("unit", "")
    if not isinstance(unit, str):
        raise ValueError(f"its unit is {shown(unit)}, not a string")
    better = f.get("better")
    if better is None:
        better = UNIT_BETTER.get(unit)
        if better is None:
            raise ValueError(f"it does not say which way is better, and its unit {shown(unit)} does not either "
                             f"(known: {', '.join(UNIT_BETTER)})")
    if better not in ("higher", "lower"):
        raise ValueError(f"its `better` is {shown(better)}, not \"higher\" or \"lower\"")
    trials = f.get("trials")
    if trials is not None and trials != []:
        return make_figure(unit, better, trials, f.get("bytes"))
    if "median" not in f:
        raise ValueError("it has neither trials nor a median")
    g = dict(f, unit=unit, better=better, trials=[])
    for k in ("min", "max"):
        g.setdefault(k, g["median"])
    for k in ("median", "min", "max"):
        if not finite(g[k]):
            raise ValueError(f"its {k} is {shown(g[k])}, not a finite number")
    if g.get("bytes") is not None and (not isinstance(g["bytes"], int) or isinstance(g["bytes"], bool)):
        raise ValueError(f"its size in bytes is {shown(g['bytes'])}, not a whole number")
    return g


def normalize_figures(figs, bad=None):
    """Each figure of `figs` (name -> figure) normalized. A figure that
    cannot be judged is left out and (name, why) added to `bad`; without
    `bad`, it is a ValueError naming it."""
    if not isinstance(figs, dict):
        raise ValueError(f"its figures are {shown(figs)[:60]}, not an object")
    out = {}
    for name, f in figs.items():
        try:
            out[name] = normalize_figure(f)
        except ValueError as e:
            if bad is None:
                raise ValueError(f"figure {name}: {e}") from None
            bad.append((name, str(e)))
    return out


def _old_duplex(d):
    """bench.rs's first format: one value per figure."""
    figs = {}
    for key, name in (("one_way", "one_way"), ("both_ways", "both_ways")):
        for b, g in d.get(key, []):
            figs[f"{name}/{size_name(b)}"] = make_figure("GB/s", "higher", [g], b)
    for key, name in (("latency_duplex_us", "latency_us"), ("latency_raw_us", "raw_latency_us"),
                      ("host_duplex_us", "host_us"), ("host_raw_us", "raw_host_us")):
        if d.get(key):
            figs[name] = make_figure("us", "lower", [d[key]])
    for lane in d.get("lanes", []):
        figs[f"lane_create_ms/{lane['name']}"] = make_figure("ms", "lower", [lane["create_ms"]])
        figs[f"lane_bytes/{lane['name']}"] = make_figure("B", "lower", [lane["bytes"]])
    meta = {"nccl": d.get("nccl"), "ctas": d.get("ctas"), "trials": 1, "format": 1}
    return meta, figs


def _old_torch(d):
    figs = {}
    for key in ("one_way", "batch", "two_pgs"):
        for b, g in d.get(key, []):
            figs[f"{key}/{size_name(b)}"] = make_figure("GB/s", "higher", [g], b)
    if d.get("latency_us"):
        figs["latency_us"] = make_figure("us", "lower", [d["latency_us"]])
    meta = {"nccl": d.get("nccl"), "torch": d.get("torch"), "trials": 1, "format": 1}
    return meta, figs


def parse_run(d, bad=None):
    """A run's JSON (either bench, either format) as (bench, meta, figures);
    bench is "duplex" or "torch". A format-2 figure that cannot be judged
    (normalize_figure) is left out and named in `bad` as (name, why), or,
    without `bad`, is a ValueError; in the old format, one bad value is a
    ValueError for the file."""
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    if d.get("format") == 2:
        bench = d.get("bench") or ("torch" if "torch" in d else "duplex")
        meta = {k: v for k, v in d.items() if k not in ("figures", "lanes")}
        figs = normalize_figures(d.get("figures", {}), bad)
        return bench, meta, figs
    try:
        if "torch" in d:
            meta, figs = _old_torch(d)
            return "torch", meta, figs
        if "one_way" in d or "latency_duplex_us" in d:
            meta, figs = _old_duplex(d)
            return "duplex", meta, figs
    except (TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"old format, not as expected ({type(e).__name__}: {e})") from None
    raise ValueError("neither duplex's nor PyTorch's benchmark JSON")


def load_json(path):
    with open(path) as f:
        return json.load(f)


def load_run(path, notes):
    """(bench, meta, figures) of a run's file, or None with a note; a
    figure that cannot be judged is a note too, and is not measured."""
    bad = []
    try:
        run = parse_run(load_json(path), bad)
    except (OSError, ValueError) as e:
        notes.append(f"{path}: not read ({e}); its figures are not measured")
        return None
    for name, why in bad:
        notes.append(f"{path}: figure {name} not read ({why}); it is not measured")
    return run


def prefixed(bench, figs):
    return {f"{bench}:{k}": v for k, v in figs.items()}


def parse_baseline(d):
    """A baseline's figures, by prefixed name: a --write-baseline file, or a
    run's JSON (old format: one trial per figure)."""
    if isinstance(d, dict) and d.get("format") == BASELINE_FORMAT:
        return normalize_figures(d.get("figures", {}))
    bench, _, figs = parse_run(d)
    return prefixed(bench, figs)


def baseline_doc(runs, sources, note=None):
    """The baseline file's content: every figure of `runs` ((bench, meta,
    figures) each) by prefixed name, and where they came from."""
    figs = {}
    made_from = []
    for (bench, meta, f), src in zip(runs, sources):
        figs.update(prefixed(bench, f))
        made_from.append({"file": src, "bench": bench, **{k: meta.get(k) for k in
                                                        ("nccl", "torch", "ctas", "trials", "format")
                                                        if meta.get(k) is not None}})
    doc = {
        "format": BASELINE_FORMAT,
        "made_from": made_from,
        "note": "written by scripts/bench_table.py --write-baseline; a figure of one trial has no "
                "spread and is compared within --tolerance",
        "figures": dict(sorted(figs.items())),
    }
    if note:
        doc["about"] = note
    return doc


def band(base, tolerance, slack):
    """The band [lo, hi] a new median may fall in without a flag, and how it
    was made."""
    if len(base.get("trials", [])) >= 2:
        pad = slack * abs(base["median"])
        how = "[min, max]" if not slack else f"[min, max] ±{slack:.0%} of the median"
        return base["min"] - pad, base["max"] + pad, how
    v = base["median"]
    return v - tolerance * abs(v), v + tolerance * abs(v), f"one trial ±{tolerance:.0%}"


WITHIN, WORSE, BETTER, MISSING, NEW, UNIT = (
    "within band", "changed beyond band (worse)", "changed beyond band (better)",
    "not measured", "new (no baseline)", "unit changed")


def compare(current, baseline, tolerance=DEFAULT_TOLERANCE, slack=DEFAULT_SLACK):
    """Each figure of `current` and `baseline` (prefixed names): a dict with
    name, verdict, base, now, band, change (now median / base median - 1)."""
    out = []
    for name in sorted(set(current) | set(baseline), key=lambda n: figure_order(n, current, baseline)):
        now, base = current.get(name), baseline.get(name)
        row = {"name": name, "now": now, "base": base, "band": None, "change": None}
        if base is None:
            row["verdict"] = NEW
        elif now is None:
            row["verdict"] = MISSING
        elif base["unit"] != now["unit"]:
            # Numbers in two units cannot be compared.
            row["verdict"] = UNIT
        else:
            lo, hi, how = band(base, tolerance, slack)
            row["band"] = (lo, hi, how)
            if base["median"]:
                row["change"] = now["median"] / base["median"] - 1
            m = now["median"]
            higher = base["better"] == "higher"
            if lo <= m <= hi:
                row["verdict"] = WITHIN
            elif (m < lo) == higher:
                row["verdict"] = WORSE
            else:
                row["verdict"] = BETTER
            # A regression: even this run's best trial is worse than the band.
            best = now.get("max", m) if higher else now.get("min", m)
            row["regressed"] = best < lo if higher else best > hi
        out.append(row)
    return out


def figure_order(name, *sources):
    """Sorts figures by bench, kind and size (1 MiB before 64 MiB)."""
    nbytes = next((s[name].get("bytes") or 0 for s in sources if name in s), 0)
    return name.rsplit("/", 1)[0] if nbytes else name, nbytes


UNIT_SHOWN = {"B": "MiB of device memory", "us": "µs"}


def strict_failures(rows):
    """What fails --strict: a figure not measured, one with no baseline
    (never judged), one whose unit is not the baseline's, or one whose
    every trial is worse than the baseline's band (a median outside the
    band alone is only flagged)."""
    return [r for r in rows if r["verdict"] in (MISSING, NEW, UNIT)
            or (r["verdict"] == WORSE and r.get("regressed"))]


DEFAULT_BASELINE = "docs/gpu/bench-baseline.json"


def rewrite_command(duplex, torch, baseline=DEFAULT_BASELINE):
    """The command that makes this run's figures the baseline."""
    return (f"python3 scripts/bench_table.py {shlex.quote(duplex)} {shlex.quote(torch)} "
            f"--write-baseline {shlex.quote(baseline)} --baseline-note \"...\"")


def few_trials(figure, min_trials):
    return len(figure.get("trials", [])) < min_trials


def strict_messages(rows, rewrite, min_trials=DEFAULT_MIN_TRIALS):
    """--strict's reasons, one line each (`bench_table: strict: ...`), from
    compare's rows; empty when it passes. `rewrite` is the command that
    rewrites the baseline from this run."""
    bad = strict_failures(rows)
    out = []
    few = [r["name"] for r in rows if r["now"] is not None and few_trials(r["now"], min_trials)]
    if few:
        out.append(f"{len(few)} figure(s) of this run have fewer than {min_trials} trials, too few to judge: "
                   + ", ".join(few))

    def names(verdict):
        return [r["name"] for r in bad if r["verdict"] == verdict]

    worse = names(WORSE)
    if worse:
        out.append(f"{len(worse)} figure(s) regressed (every trial worse than the baseline's band): "
                   + ", ".join(worse))
    units = [f"{r['name']} (baseline {r['base']['unit'] or 'no unit'}, now {r['now']['unit'] or 'no unit'})"
             for r in bad if r["verdict"] == UNIT]
    if units:
        out.append(f"{len(units)} figure(s) changed unit, so they cannot be compared: " + ", ".join(units))
    missing = names(MISSING)
    if missing:
        out.append(f"{len(missing)} baseline figure(s) not measured in this run: " + ", ".join(missing))
    new = names(NEW)
    if new:
        out.append(f"{len(new)} figure(s) have no baseline, so they were not judged: " + ", ".join(new)
                   + f"; once this run is checked ({min_trials} trials or more, on the GPUs), make it the baseline: "
                   + rewrite)
    return [f"bench_table: strict: {m}" for m in out]


def median_of(figs, name):
    f = figs.get(name)
    return None if f is None else f["median"]


def targets(figs):
    """The targets of issue 12 on the merged figures (prefixed names), from
    medians: a list of (target, met: True/False/None, measured)."""
    rows = []

    def add(text, met, measured):
        rows.append((text, met, measured))

    for size in ("256MiB", "64MiB"):
        label = size.replace("MiB", " MiB")
        both, one = median_of(figs, f"duplex:both_ways/{size}"), median_of(figs, f"duplex:one_way/{size}")
        text = f"{label} both ways at once ≥ 0.97× duplex's one way, per direction"
        if both is None or not one:
            add(text, None, "not measured")
        else:
            add(text, both >= 0.97 * one, f"{both / one:.3f}× ({both:.1f} / {one:.1f} GB/s)")
        best = [(median_of(figs, f"torch:{k}/{size}"), n) for k, n in
                (("batch", "batch_isend_irecv"), ("two_pgs", "one PG per direction"))]
        best = [(v, n) for v, n in best if v is not None]
        text = f"{label} both ways at once ≥ PyTorch's best both ways, per direction"
        if both is None or not best:
            add(text, None, "not measured")
        else:
            v, n = max(best)
            add(text, both >= v, f"{both / v:.3f}× ({both:.1f} vs {n} {v:.1f} GB/s)")
    for size in ("256MiB", "64MiB", "1MiB"):
        label = size.replace("MiB", " MiB")
        d, r = median_of(figs, f"duplex:one_way/{size}"), median_of(figs, f"duplex:raw_one_way/{size}")
        text = f"{label} one way within 1% of raw NCCL (≥ 0.99×)"
        if d is None or not r:
            add(text, None, "not measured")
        else:
            add(text, d >= 0.99 * r, f"{d / r:.3f}× ({d:.1f} vs {r:.1f} GB/s)")
    # Copy-engine lanes (item 4): both ways at once against PyTorch's best
    # and against raw peer copies one way.
    both = median_of(figs, "duplex:copy_both_ways/256MiB")
    best = [(median_of(figs, f"torch:{k}/256MiB"), n) for k, n in
            (("batch", "batch_isend_irecv"), ("two_pgs", "one PG per direction"))]
    best = [(v, n) for v, n in best if v is not None]
    text = "256 MiB both ways at once on copy-engine lanes ≥ 1.08× PyTorch's best both ways, per direction"
    if both is None or not best:
        add(text, None, "not measured")
    else:
        v, n = max(best)
        add(text, both >= 1.08 * v, f"{both / v:.3f}× ({both:.1f} vs {n} {v:.1f} GB/s)")
    ce = median_of(figs, "duplex:ce_one_way/256MiB")
    text = "256 MiB both ways at once on copy-engine lanes ≥ 0.97× raw peer copies one way, per direction"
    if both is None or not ce:
        add(text, None, "not measured")
    else:
        add(text, both >= 0.97 * ce, f"{both / ce:.3f}× ({both:.1f} vs {ce:.1f} GB/s)")
    d, c = median_of(figs, "duplex:lane_latency_us"), median_of(figs, "duplex:copy_latency_us")
    text = "4 KiB latency unchanged with copy-engine lanes on (≤ 1.05× without; policy-placed, half a round trip)"
    if d is None or c is None:
        add(text, None, "not measured")
    else:
        add(text, c <= 1.05 * d, f"{c / d:.3f}× ({c:.2f} vs {d:.2f} µs)")
    for key, text in (("latency_us", "4 KiB half round trip within 1 µs of raw NCCL (same communicators and stream)"),
                      ("host_us", "host time per op ≤ 1 µs over raw ncclSend/ncclRecv")):
        d, r = median_of(figs, f"duplex:{key}"), median_of(figs, f"duplex:raw_{key}")
        if d is None or r is None:
            add(text, None, "not measured")
        else:
            add(text, d - r <= 1.0 + 1e-9, f"{d - r:+.2f} µs ({d:.2f} vs {r:.2f} µs)")
    return rows


def fmt_value(f, unit=None):
    unit = unit or f.get("unit")
    if unit == "B":
        return lambda v: f"{v / (1 << 20):.1f}"
    if unit == "us":
        return lambda v: f"{v:.2f}"
    return lambda v: f"{v:.1f}"


def spread(f):
    """median [min–max], or the value alone for one trial."""
    p = fmt_value(f)
    if len(f.get("trials", [])) <= 1:
        return p(f["median"])
    return f"{p(f['median'])} [{p(f['min'])}–{p(f['max'])}]"


def baseline_warning(rows, rewrite, min_trials=DEFAULT_MIN_TRIALS):
    """What to say of a baseline with figures of fewer than `min_trials`
    trials (judged all the same: one trial within --tolerance), or None."""
    few = [r["name"] for r in rows if r["base"] is not None and few_trials(r["base"], min_trials)]
    if not few:
        return None
    return (f"the baseline has {len(few)} figure(s) of fewer than {min_trials} trials (a figure of one trial "
            f"is judged within ±tolerance of its value): replace it with a run of {min_trials} trials or more "
            f"on the GPUs: {rewrite}")


def render(current, meta, rows=None, baseline_name=None, ctas=(), notes=(), base_note=None):
    """The Markdown report: tables, targets and (with `rows` from compare)
    the comparison with the baseline (`base_note`: a note under its
    heading)."""
    flagged = {r["name"] for r in rows or [] if r["verdict"] in (WORSE, BETTER)}
    out = []
    p = out.append

    def cell(name):
        f = current.get(name)
        if f is None:
            return "–"
        return spread(f) + (" †" if name in flagged else "")

    d, t = meta.get("duplex", {}), meta.get("torch", {})
    p(f"duplex: NCCL {d.get('nccl', '?')} (system library), lane CTAs "
      f"{ctas_label(d.get('ctas'))}, {d.get('trials', '?')} trial(s) per figure. "
      f"PyTorch {t.get('torch', '?')} with NCCL {t.get('nccl', '?')}, {t.get('trials', '?')} trial(s) per figure.")
    p("")
    p("Each cell: the median of the trials [min–max]; ratios are of medians."
      + (" † marks a figure whose median lies outside the baseline's band (see the comparison)." if rows else ""))
    for n in notes:
        p("")
        p(f"Note: {n}")
    p("")
    p("### Bandwidth, GB/s per direction")
    p("")
    p("| size | duplex one way | raw NCCL one way | PyTorch one way | duplex both ways (each) "
      "| raw NCCL both ways (each) | PyTorch batch_isend_irecv (each) | PyTorch one PG per direction (each) "
      "| duplex both / one way | duplex both / PyTorch's best |")
    p("|---|---|---|---|---|---|---|---|---|---|")
    sizes = sorted({f["bytes"] for f in current.values() if f.get("bytes")} or set(SIZES))
    for b in sizes:
        s = size_name(b)
        both, one = median_of(current, f"duplex:both_ways/{s}"), median_of(current, f"duplex:one_way/{s}")
        best = max([v for v in (median_of(current, f"torch:batch/{s}"), median_of(current, f"torch:two_pgs/{s}"))
                    if v is not None], default=None)
        r1 = f"{both / one:.3f}×" if both is not None and one else "–"
        r2 = f"{both / best:.3f}×" if both is not None and best else "–"
        p(f"| {s.replace('MiB', ' MiB')} | {cell(f'duplex:one_way/{s}')} | {cell(f'duplex:raw_one_way/{s}')} "
          f"| {cell(f'torch:one_way/{s}')} | {cell(f'duplex:both_ways/{s}')} | {cell(f'duplex:raw_both_ways/{s}')} "
          f"| {cell(f'torch:batch/{s}')} | {cell(f'torch:two_pgs/{s}')} | {r1} | {r2} |")
    p("")
    p("### Latency and host overhead, µs")
    p("")
    p("| | duplex | raw NCCL, same communicators and stream | PyTorch | duplex − raw |")
    p("|---|---|---|---|---|")
    for key, label, torch in (("latency_us", "4 KiB, half a round trip", "torch:latency_us"),
                              ("host_us", "host time to enqueue one 4 KiB op", None)):
        dm, rm = median_of(current, f"duplex:{key}"), median_of(current, f"duplex:raw_{key}")
        diff = f"{dm - rm:+.2f}" if dm is not None and rm is not None else "–"
        p(f"| {label} | {cell(f'duplex:{key}')} | {cell(f'duplex:raw_{key}')} "
          f"| {cell(torch) if torch else '–'} | {diff} |")
    if "duplex:lane_latency_us" in current or "duplex:copy_latency_us" in current:
        p(f"| 4 KiB placed by the policy, half a round trip | {cell('duplex:lane_latency_us')} | – | – | – |")
        p(f"| the same with copy-engine lanes on (4 KiB stays below their threshold) "
          f"| {cell('duplex:copy_latency_us')} | – | – | – |")
    copy_sizes = sorted({f["bytes"] for k, f in current.items() if k.startswith("duplex:copy_") and f.get("bytes")})
    if copy_sizes:
        p("")
        p("### Copy-engine lanes, GB/s per direction")
        p("")
        p("| size | copy lane one way | raw peer copy one way | copy lanes both ways (each) "
          "| raw peer copies both ways (each) | duplex NCCL lanes both ways (each) |")
        p("|---|---|---|---|---|---|")
        for b in copy_sizes:
            s = size_name(b)
            p(f"| {s.replace('MiB', ' MiB')} | {cell(f'duplex:copy_one_way/{s}')} | {cell(f'duplex:ce_one_way/{s}')} "
              f"| {cell(f'duplex:copy_both_ways/{s}')} | {cell(f'duplex:ce_both_ways/{s}')} "
              f"| {cell(f'duplex:both_ways/{s}')} |")
    th = d.get("copy_threshold")
    if isinstance(th, dict):
        p("")
        secs = d.get("copy_threshold_s")
        took = f", which took {secs:.2f} s" if isinstance(secs, (int, float)) else ""
        p(f"### The threshold the transport measured (`Local::measure_copy_from`{took})")
        p("")
        p(f"Host time per message, µs, median of {th.get('trials', '?')} trials.")
        p("")
        p("| size | NCCL lane one way | copy lane one way | NCCL lanes both ways | copy lanes both ways | faster |")
        p("|---|---|---|---|---|---|")
        keys = ("nccl_one_way", "copy_one_way", "nccl_both_ways", "copy_both_ways")
        for r in th.get("sizes", []) if isinstance(th.get("sizes"), list) else []:
            if not isinstance(r, dict):
                continue
            v = [r.get(k) for k in keys]
            cells = " | ".join(f"{x:.1f}" if finite(x) else "–" for x in v)
            faster = "–"
            if all(finite(x) for x in v):
                faster = "copy" if v[1] + v[3] < v[0] + v[2] else "nccl"
            b = r.get("bytes")
            size = size_name(b).replace("MiB", " MiB").replace("KiB", " KiB") if finite(b) else "?"
            p(f"| {size} | {cells} | {faster} |")
        p("")
        c = th.get("copy_from")
        chosen = (size_name(c) if finite(c) else shown(c) if c is not None
                  else "off (copy lanes not faster at the largest size measured)")
        p(f"Chosen: `copy_from` {chosen}.")
    lanes = sorted({k.split("/", 1)[1] for k in current if k.startswith("duplex:lane_create_ms/")})
    if lanes:
        p("")
        p("### Lane cost (rank 1's lanes, one trial per run)")
        p("")
        p("| lane | creation, ms | device memory, MiB |")
        p("|---|---|---|")
        for lane in lanes:
            p(f"| {lane} | {cell(f'duplex:lane_create_ms/{lane}')} | {cell(f'duplex:lane_bytes/{lane}')} |")
    if ctas:
        p("")
        p("### Lane settings, 256 MiB, duplex only")
        p("")
        p("A lane's device memory and creation time are rank 1's lane `lane:0->1`, one trial per run.")
        p("")
        p("| lane CTAs | NCCL environment (beyond the main run's) | lane memory, MiB | lane creation, ms "
          "| one way | both ways (each) | both / one way | both / PyTorch's best |")
        p("|---|---|---|---|---|---|---|---|")
        best = max([v for v in (median_of(current, "torch:batch/256MiB"), median_of(current, "torch:two_pgs/256MiB"))
                    if v is not None], default=None)
        main_env = d.get("env") or {}
        main_figs = {k[7:]: v for k, v in current.items() if k.startswith("duplex:")}
        for label, env, figs in [(ctas_label(d.get("ctas")), main_env, main_figs)] + list(ctas):
            both = figs.get("both_ways/256MiB")
            r2 = f"{both['median'] / best:.3f}×" if both and best else "–"
            p(f"| {label} | {env_label(env, main_env)} | {setting_cells(figs)} | {r2} |")
    p("")
    p("### Targets (issue 12; medians)")
    p("")
    p("| target | met | measured |")
    p("|---|---|---|")
    for text, met, measured in targets(current):
        p(f"| {text} | {'yes' if met else '**no**' if met is False else 'not measured'} | {measured} |")
    if rows is not None:
        p("")
        p(f"### Compared with the baseline ({baseline_name})")
        p("")
        if base_note:
            p(f"Note: {base_note}.")
            p("")
        counts = {}
        for r in rows:
            counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
        p("; ".join(f"{n} {v}" for v, n in sorted(counts.items())) + ".")
        p("")
        p("| figure | baseline: median [min–max] (trials) | now: median [min–max] | change | band | verdict |")
        p("|---|---|---|---|---|---|")
        for r in rows:
            base, now = r["base"], r["now"]
            bs = f"{spread(base)} ({len(base.get('trials', []))})" if base else "–"
            ns = spread(now) if now else "–"
            ch = f"{r['change']:+.1%}" if r["change"] is not None else "–"
            bd = "–"
            if r["band"]:
                f = fmt_value(base)
                bd = f"{f(r['band'][0])}–{f(r['band'][1])} ({r['band'][2]})"
            v = f"**{r['verdict']}**" if r["verdict"] in (WORSE, MISSING, NEW, UNIT) else r["verdict"]
            if r["verdict"] == UNIT:
                v += f" ({base['unit'] or 'no unit'} → {now['unit'] or 'no unit'})"
            f0 = base or now
            p(f"| {r['name']} ({UNIT_SHOWN.get(f0['unit'], f0['unit'])}, {f0['better']} is better) "
              f"| {bs} | {ns} | {ch} | {bd} | {v} |")
    return "\n".join(out) + "\n"


def env_label(env, main_env, same="as the main run"):
    """The NCCL_* settings of `env` that differ from the main run's."""
    keys = sorted(set(env) | set(main_env))
    diff = [f"{k}={env[k]}" if k in env else f"{k} unset" for k in keys if env.get(k) != main_env.get(k)]
    return ", ".join(diff) if diff else same


def ctas_label(c):
    if not c or (isinstance(c, list) and all(v is None for v in c)):
        return "NCCL's default"
    if not isinstance(c, list) or len(c) != 2:
        return shown(c)
    lo, hi = c
    return str(lo) if lo == hi else f"{lo}–{hi}"


def setting_cells(figs):
    """A lane setting's cells, as both settings tables show them: lane memory,
    lane creation, 256 MiB one way and both ways, both / one way."""
    one, both = figs.get("one_way/256MiB"), figs.get("both_ways/256MiB")
    mem, made = figs.get("lane_bytes/lane:0->1"), figs.get("lane_create_ms/lane:0->1")
    r1 = f"{both['median'] / one['median']:.3f}×" if one and both else "–"
    return " | ".join([spread(mem) if mem else "–", spread(made) if made else "–",
                       spread(one) if one else "–", spread(both) if both else "–", r1])


def settings_table(runs):
    """The lane-settings table of `runs`, [(label, env, figures)], the first
    the reference: lane memory, creation time, 256 MiB bandwidths, and
    memory and both-ways bandwidth relative to the reference."""
    out = ["| lane CTAs | NCCL environment (beyond the first row's) | lane memory, MiB | lane creation, ms "
           "| one way | both ways (each) | both / one way | memory / first row's | both ways / first row's |",
           "|---|---|---|---|---|---|---|---|---|"]
    first_env = runs[0][1] if runs else {}
    ref = runs[0][2] if runs else {}

    def ratio(figs, name):
        a, b = figs.get(name), ref.get(name)
        return f"{a['median'] / b['median']:.3f}×" if a and b and b["median"] else "–"
    for label, env, figs in runs:
        out.append(f"| {label} | {env_label(env, first_env, 'as the first row')} | {setting_cells(figs)} "
                   f"| {ratio(figs, 'lane_bytes/lane:0->1')} | {ratio(figs, 'both_ways/256MiB')} |")
    return "\n".join(out) + "\n"


def settings_main(paths):
    """`--settings-only FILE...`: the lane-settings table alone."""
    if not paths:
        print("bench_table: --settings-only needs at least the reference run's JSON", file=sys.stderr)
        return 2
    notes, runs = [], []
    for path in paths:
        run = load_run(path, notes)
        if run is not None:
            runs.append((ctas_label(run[1].get("ctas")), run[1].get("env") or {}, run[2]))
    out = ["### Lane settings, 256 MiB (`scripts/gpu.sh run lanes`)", ""]
    out += [f"Note: {n}" for n in notes] + ([""] if notes else [])
    if not runs:
        out.append("No run was read.")
    else:
        out.append("A lane's device memory and creation time are rank 1's lane `lane:0->1`, one trial per run; "
                   "bandwidths are medians [min–max].")
        out.append("")
        out.append(settings_table(runs))
    sys.stdout.write("\n".join(out).rstrip("\n") + "\n")
    return 0 if runs else 1


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--settings-only":
        return settings_main(argv[1:])
    ap = argparse.ArgumentParser(description="duplex's and PyTorch's benchmark tables")
    ap.add_argument("duplex")
    ap.add_argument("torch")
    ap.add_argument("--baseline", action="append", default=[])
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    ap.add_argument("--slack", type=float, default=DEFAULT_SLACK)
    ap.add_argument("--strict", action="store_true")
    ap.add_argument("--min-trials", type=int, default=DEFAULT_MIN_TRIALS)
    ap.add_argument("--write-baseline")
    ap.add_argument("--baseline-note", help="what the written baseline is (the run, the machine)")
    ap.add_argument("--setting", "--ctas", dest="settings", action="append", default=[])
    a = ap.parse_args(argv)
    if a.tolerance < 0 or a.slack < 0:
        ap.error("--tolerance and --slack are fractions ≥ 0")
    if a.min_trials < 1:
        ap.error("--min-trials is a whole number ≥ 1")
    if a.strict and not a.baseline:
        ap.error("--strict needs --baseline: without a baseline nothing is compared, "
                 "and a strict run that compared nothing would pass")
    notes = []
    current, meta, runs, sources = {}, {}, [], []
    for path, want in ((a.duplex, "duplex"), (a.torch, "torch")):
        run = load_run(path, notes)
        if run is None:
            continue
        bench, m, figs = run
        if bench != want:
            notes.append(f"{path}: is {bench}'s benchmark, given as {want}'s")
        meta[bench] = m
        current.update(prefixed(bench, figs))
        runs.append(run)
        sources.append(path)
    ctas = []
    for path in a.settings:
        run = load_run(path, notes)
        if run is not None:
            ctas.append((ctas_label(run[1].get("ctas")), run[1].get("env") or {}, run[2]))
    rows, base_name, unread, base_note = None, None, None, None
    target = a.baseline[0] if len(a.baseline) == 1 else DEFAULT_BASELINE
    rewrite = rewrite_command(a.duplex, a.torch, target)
    if a.baseline:
        baseline = {}
        for path in a.baseline:
            try:
                baseline.update(parse_baseline(load_json(path)))
            except (OSError, ValueError) as e:
                unread = (f"the baseline {path} could not be read ({e}): "
                          "no figure was compared with a baseline")
                notes.append(unread)
                break
        else:
            rows = compare(current, baseline, a.tolerance, a.slack)
            base_name = ", ".join(a.baseline)
            base_note = baseline_warning(rows, rewrite, a.min_trials)
    sys.stdout.write(render(current, meta, rows, base_name, ctas, notes, base_note))
    if base_note:
        print(f"bench_table: warning: {base_note}", file=sys.stderr)
    if unread:
        print(f"bench_table: {unread}", file=sys.stderr)
        return 2
    if a.write_baseline:
        if not runs:
            print("bench_table: nothing to write a baseline from", file=sys.stderr)
            return 2
        with open(a.write_baseline, "w") as f:
            json.dump(baseline_doc(runs, sources, a.baseline_note), f, indent=1)
            f.write("\n")
        print(f"\nBaseline written to {a.write_baseline} ({len(current)} figures).", file=sys.stderr)
    if a.strict and rows is not None:
        bad = strict_messages(rows, rewrite, a.min_trials)
        if bad:
            print("\n".join(bad), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
