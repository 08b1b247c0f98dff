"""The GPU nightly's verdict: reads what `scripts/gpu.sh run` left in OUT
and says, step by step, whether the run passed.

usage: python3 nightly_verdict.py OUT [--known FILE]

Reads OUT/steps.txt (one line per command the run made: NAME EXIT-STATUS;
the last line of a name counts) and the reports of each step:

  build      `scripts/gpu.sh build` exits 0 (or "staged": no cargo here, the
             staged .gpu/ was used)
  suite      the libtest binary (tests/tests/nccl.rs) exits 0, prints
             "ran N scenarios" with N at least 1, N scenario lines all
             PASS, and "test result: ok." with at least one test passed
             (OUT/suite.txt)
  suite-lazy the same suite with lanes made on first use
             (DUPLEX_LANES=lazy), judged the same way (OUT/suite-lazy.txt)
  suite-cold the same suite with every communicator connected on first use
             (DUPLEX_COLD=1), judged the same way (OUT/suite-cold.txt)
  faults     `faults drive` exits 0, and its table (OUT/faults.md) has a row
             per case, none FAIL, and "K of K cases passed"
  faults-lazy the same matrix with lanes made on first use
             (OUT/faults-lazy.md)
  calibrate  `duplex calibrate --format markdown` exits 0 (1: some example
             disagrees), and its table (OUT/calibration.md) has every example
             agreeing ("yes" or "consistent: ..."), except the disagreements
             listed in --known (an example, its real outcome and the
             checker's verdict, all three as the table says them, with the
             reason); a listed disagreement whose example now agrees, or
             is not in the table at all, fails too, so that the list only
             ever excuses what still happens
  bench      bench and bench_torch.py exit 0 and write their JSON, and
             `bench_table.py --strict --baseline ...` exits 0: no figure has
             every trial worse than the committed baseline's band (its
             [min, max] widened by the slack, 5% of its median), none went
             unmeasured, none is without a baseline, changed unit or has
             fewer than 5 trials. Its exit status 2 (a baseline that could
             not be read: nothing was compared) fails the step as such; its
             exit status 1 is a regression only with a `bench_table:
             strict:` line in OUT/bench-compare.log, else a crash, whose
             log tail is quoted; its warning that the baseline has figures
             of fewer than 5 trials is passed on. And the copy-engine lane
             checks (`copylane`, OUT/copylane.txt) exit 0. The
             lane-settings sweep (bench-ctas-N, bench-env-N) is reported,
             not judged.
  ipc        `ipc_probe.py` exits 0 on two GPUs and on one (steps ipc,
             ipc-one-gpu), and OUT/ipc.md has both tables, each with every
             figure measured (a number as its median); and
             `ipc_flags_probe.py` exits 0 on both (ipc-flags,
             ipc-flags-one-gpu: every check passed)

Writes OUT/nightly.md and OUT/nightly.json, prints the former, and exits 1
when any step failed (0 when all passed; 2 for a wrong command line, an OUT
that is not a directory, or a known list that cannot be read).
"""
import argparse
import json
import os
import re
import sys

STEPS = ("build", "suite", "suite-lazy", "suite-cold", "faults", "faults-lazy", "calibrate", "bench", "ipc")
# The figures of each table of scripts/ipc_probe.py, and the tables.
IPC_FIGURES = ("4KiB copy us", "both-ways GB/s (A)", "both-ways GB/s (B)", "event-open us",
               "mem-close us", "mem-open us", "one-way GB/s")
IPC_TABLES = (("two GPUs", "(GPU 0 and GPU 1, a process each)"), ("one GPU", "(one GPU, two processes)"))
TIMED_OUT = {124: "timed out", 137: "killed (timed out or out of memory)"}


def status_text(rc):
    if rc is None:
        return "did not run"
    return TIMED_OUT.get(rc, f"exit status {rc}")


def read_steps(text):
    """NAME -> exit status (int, or a word such as "staged"); the last line
    of each name wins."""
    steps = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            try:
                steps[parts[0]] = int(parts[1])
            except ValueError:
                steps[parts[0]] = parts[1]
    return steps


# The steps whose disagreements the known list may excuse.
KNOWN_STEPS = ("calibrate",)


KNOWN_FORM = "calibrate SUBJECT OUTCOME CHECKER  # reason"


def read_known(text):
    """The known disagreements: (step, subject, outcome, checker) -> reason,
    from lines `STEP SUBJECT OUTCOME CHECKER  # reason`: SUBJECT the
    example, OUTCOME its real outcome and CHECKER the checker's verdict, as
    the calibration table's columns say them. A disagreement is excused
    only while all four match: the same crash with another checker verdict
    (the model changed its mind) is a new disagreement."""
    known = {}
    for line in text.splitlines():
        body, _, reason = line.partition("#")
        parts = body.split()
        if not parts:
            continue
        if len(parts) != 4:
            hint = (" (the checker's verdict is missing: add the table's checker column, e.g. `deadlock`)"
                    if len(parts) == 3 else "")
            raise ValueError(f"known disagreements: `{line.strip()}` has {len(parts)} field(s), "
                             f"not 4: a line is `{KNOWN_FORM}`{hint}")
        if parts[0] not in KNOWN_STEPS:
            raise ValueError(f"known disagreements: `{line.strip()}`: only {', '.join(KNOWN_STEPS)} "
                             "disagreements can be excused")
        known[tuple(parts)] = reason.strip()
    return known


def judge_build(rc):
    if rc == 0:
        return True, ["built with cargo"]
    if rc == "staged":
        return True, ["no cargo on this machine: used the staged .gpu/"]
    return False, [f"build: {status_text(rc)} (build.log)"]


SCENARIO = re.compile(r"(?:^|\.\.\. )(PASS|FAIL) +(\S+) +(\d+\.\d+) s\b", re.M)
RAN = re.compile(r"^ran (\d+) scenarios on NCCL", re.M)
RESULT = re.compile(r"^test result: (ok|FAILED)\. (\d+) passed; (\d+) failed", re.M)


def judge_suite(text, rc):
    """(passed, reasons, details) of the conformance suite's output."""
    reasons = []
    if rc is None:
        return False, ["the suite did not run"], {}
    scenarios = SCENARIO.findall(text or "")
    failed = [name for verdict, name, _ in scenarios if verdict == "FAIL"]
    details = {"scenarios": len(scenarios), "failed": failed}
    if rc != 0:
        reasons.append(f"the suite binary: {status_text(rc)}")
    if failed:
        reasons.append(f"{len(failed)} scenario(s) failed: {', '.join(failed)}")
    if not scenarios:
        reasons.append("no scenario ran: a suite of 0 scenarios judges nothing")
    ran = RAN.search(text or "")
    if not ran:
        reasons.append("no `ran N scenarios` line: the suite did not finish (or did not run its scenarios)")
    elif int(ran.group(1)) != len(scenarios):
        reasons.append(f"it says it ran {ran.group(1)} scenarios, and {len(scenarios)} scenario lines were found")
    result = RESULT.search(text or "")
    if not result:
        reasons.append("no libtest `test result:` line")
    elif result.group(1) != "ok" or int(result.group(2)) < 1:
        reasons.append(f"libtest: {result.group(0)}")
    ok = not reasons
    if ok:
        reasons.append(f"{len(scenarios)} of {len(scenarios)} scenarios passed")
    return ok, reasons, details


FAULTS_SUMMARY = re.compile(r"^(\d+) of (\d+) cases passed", re.M)


def judge_faults(text, rc):
    if rc is None:
        return False, ["the fault matrix did not run"], {}
    reasons = []
    if text is None:
        return False, [f"faults drive: {status_text(rc)}; no faults.md"], {}
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().split("|")]
        if len(cells) < 4 or not line.startswith("|") or cells[1] in ("case", "") or set(cells[1]) <= {"-"}:
            continue
        rows.append((cells[1], cells[-2]))
    failed = [case for case, result in rows if not result.startswith("PASS")]
    details = {"cases": len(rows), "failed": failed}
    if rc != 0:
        reasons.append(f"faults drive: {status_text(rc)}")
    if not rows:
        reasons.append("faults.md has no case rows")
    if failed:
        reasons.append(f"{len(failed)} case(s) failed: {', '.join(failed)}")
    summary = FAULTS_SUMMARY.search(text)
    if not summary:
        reasons.append("faults.md has no `K of N cases passed` line")
    elif summary.group(1) != summary.group(2) or int(summary.group(2)) != len(rows):
        reasons.append(f"faults.md: {summary.group(0)} ({len(rows)} rows)")
    ok = not reasons
    if ok:
        reasons.append(f"{len(rows)} of {len(rows)} cases passed")
    return ok, reasons, details


CAL_HEADER = "| example | real outcome | time (s) | checker | agree |"
# "K of N examples agree." or "K of N examples agree; M could not run
# with this launch." (those M are among the N - K that do not agree).
CAL_SUMMARY = re.compile(r"^(\d+) of (\d+) examples agree[.;]", re.M)


def calibration_rows(text):
    rows, inside = [], False
    for line in text.splitlines():
        if line.strip() == CAL_HEADER:
            inside = True
            continue
        if not inside:
            continue
        if not line.startswith("|"):
            if rows or line.strip():
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set("".join(cells)) <= {"-"}:
            continue
        if len(cells) == 5:
            rows.append({"example": cells[0], "real": cells[1], "checker": cells[3], "agree": cells[4]})
    return rows


def agrees(row):
    return row["agree"] == "yes" or row["agree"].startswith("consistent")


def judge_calibration(text, rc, known):
    if rc is None:
        return False, ["the calibration did not run"], {}
    if text is None:
        return False, [f"duplex calibrate: {status_text(rc)}; no calibration.md"], {}
    reasons, notes = [], []
    rows = calibration_rows(text)
    disagree = [r for r in rows if not agrees(r)]
    unknown = []
    for r in disagree:
        reason = known.get(("calibrate", r["example"], r["real"], r["checker"]))
        if reason is None:
            unknown.append(r)
        else:
            notes.append(f"known: {r['example']} ({r['real']}, checker {r['checker']}): {reason}")
    # A listed disagreement that no longer happens: its example ran and
    # agreed, or is not in the table at all (renamed or removed). One whose
    # example ran with another disagreeing outcome or checker verdict is an
    # unknown disagreement above.
    agreeing = {r["example"] for r in rows if agrees(r)}
    listed = {subject for (step, subject, _, _) in known if step == "calibrate"}
    stale = sorted(s for s in listed if s in agreeing)
    absent = sorted(s for s in listed if rows and s not in {r["example"] for r in rows})
    details = {"examples": len(rows), "disagree": [r["example"] for r in disagree],
               "unknown": [r["example"] for r in unknown], "stale": stale, "absent": absent}
    if not rows:
        reasons.append(f"calibration.md has no example table (duplex calibrate: {status_text(rc)}; see calibration.log)")
    if unknown:
        reasons.append(f"{len(unknown)} example(s) disagree with the model: "
                       + ", ".join(f"{r['example']} (real {r['real']}, checker {r['checker']})" for r in unknown))
    if stale:
        reasons.append(f"{len(stale)} known disagreement(s) no longer happen: {', '.join(stale)} "
                       "agreed with the model; remove their lines from the known list (scripts/nightly-known.txt)")
    if absent:
        reasons.append(f"{len(absent)} known disagreement(s) name an example the calibration did not run: "
                       f"{', '.join(absent)}; a renamed or removed example? Fix or remove their lines in the "
                       "known list (scripts/nightly-known.txt)")
    if rc not in (0, 1):
        reasons.append(f"duplex calibrate: {status_text(rc)}")
    elif rc == 1 and not disagree:
        reasons.append("duplex calibrate exited 1 (a disagreement) but its table shows none")
    elif rc == 0 and disagree:
        reasons.append("duplex calibrate exited 0 but its table shows a disagreement")
    summary = CAL_SUMMARY.search(text)
    if rows and not summary:
        reasons.append("calibration.md has no `K of N examples agree.` line")
    elif summary and (int(summary.group(2)) != len(rows) or int(summary.group(1)) != len(rows) - len(disagree)):
        reasons.append(f"calibration.md: {summary.group(0)}, but its table has {len(rows)} rows, "
                       f"{len(disagree)} disagreeing")
    ok = not reasons
    if ok:
        reasons.append(f"{len(rows) - len(disagree)} of {len(rows)} examples agree"
                       + (f", {len(disagree)} known disagreement(s)" if disagree else ""))
    return ok, reasons + notes, details


def bench_json_ok(path):
    try:
        with open(path) as f:
            d = json.load(f)
        return d.get("format") == 2 and bool(d.get("figures"))
    except (OSError, ValueError, AttributeError):
        return False


def judge_bench(steps, out):
    reasons, notes = [], []
    for name, label, path in (("bench", "duplex's bench", "bench-duplex.json"),
                              ("bench-torch", "bench_torch.py", "bench-torch.json")):
        rc = steps.get(name)
        if rc != 0:
            reasons.append(f"{label}: {status_text(rc)}")
        if rc is not None and not bench_json_ok(os.path.join(out, path)):
            reasons.append(f"{path} is missing or not a format-2 result")
    rc = steps.get("bench-table")
    log = read(os.path.join(out, "bench-compare.log")) or ""
    # Said whatever the outcome: the baseline has figures of too few trials.
    notes += [l[len("bench_table: "):] for l in log.splitlines() if l.startswith("bench_table: warning:")]
    if rc == 1:
        # A regression only where bench_table says so; exit status 1 with no
        # such line is Python's own (an uncaught exception).
        lines = [l for l in log.splitlines() if l.startswith("bench_table: strict:")]
        if lines:
            reasons.append("; ".join(lines))
        else:
            tail = log.strip()[-300:]
            reasons.append("bench_table.py crashed (exit status 1, and no `bench_table: strict:` line)"
                           + (f": {tail}" if tail else "; bench-compare.log is empty"))
    elif rc != 0:
        said = [l for l in log.splitlines() if l.startswith("bench_table:")]
        if rc == 2 and any("baseline" in l and "could not be read" in l for l in said):
            reasons.append("the benchmark baseline could not be read, so no figure was judged: " + "; ".join(said))
        else:
            reasons.append(f"bench_table.py: {status_text(rc)}" + (f": {log.strip()[-300:]}" if log.strip() else ""))
    rc = steps.get("copylane")
    if rc is None:
        reasons.append("the copy-engine lane checks (copylane) did not run")
    elif rc != 0:
        fails = [l for l in (read(os.path.join(out, "copylane.txt")) or "").splitlines()
                 if l.startswith("FAIL")]
        reasons.append(f"copylane: {status_text(rc)}" + (f": {'; '.join(fails)}" if fails else ""))
    for name in sorted(k for k in steps if k.startswith(("bench-ctas-", "bench-env-"))):
        if steps[name] != 0:
            notes.append(f"lane-settings sweep {name[len('bench-'):]}: {status_text(steps[name])} (not judged)")
    ok = not reasons
    if ok:
        reasons.append("every figure measured and judged against the baseline, none with every trial worse "
                       "than its band (benchmarks.md)")
    return ok, reasons + notes, {}


def judge_ipc(text, steps):
    reasons = []
    for name in ("ipc", "ipc-one-gpu", "ipc-flags", "ipc-flags-one-gpu"):
        rc = steps.get(name)
        if rc != 0:
            reasons.append(f"{name}: {status_text(rc)}")
    if text is None:
        reasons.append("no ipc.md")
    else:
        for label, title in IPC_TABLES:
            start = text.find("### CUDA IPC between two processes " + title)
            if start < 0:
                reasons.append(f"ipc.md has no table for {label}")
                continue
            end = text.find("###", start + 3)
            rows = {}
            for line in text[start:end if end >= 0 else len(text)].splitlines():
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if len(cells) == 2:
                    rows[cells[0]] = cells[1]
            for fig in IPC_FIGURES:
                median = rows.get(fig, "").split(" ")[0]
                try:
                    float(median)
                except ValueError:
                    reasons.append(f"{label}: `{fig}` not measured")
    ok = not reasons
    if ok:
        reasons.append("CUDA IPC measured on two GPUs and on one (ipc.md)")
    return ok, reasons, {}


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return None


def verdict(out, known):
    steps = read_steps(read(os.path.join(out, "steps.txt")) or "")
    results = []
    ok, why = judge_build(steps.get("build"))
    results.append(("build", ok, why, {}))
    results.append(("suite", *judge_suite(read(os.path.join(out, "suite.txt")), steps.get("suite"))))
    results.append(("suite-lazy", *judge_suite(read(os.path.join(out, "suite-lazy.txt")),
                                               steps.get("suite-lazy"))))
    results.append(("suite-cold", *judge_suite(read(os.path.join(out, "suite-cold.txt")),
                                               steps.get("suite-cold"))))
    results.append(("faults", *judge_faults(read(os.path.join(out, "faults.md")), steps.get("faults"))))
    results.append(("faults-lazy", *judge_faults(read(os.path.join(out, "faults-lazy.md")),
                                                 steps.get("faults-lazy"))))
    results.append(("calibrate", *judge_calibration(read(os.path.join(out, "calibration.md")),
                                                    steps.get("calibrate"), known)))
    results.append(("bench", *judge_bench(steps, out)))
    results.append(("ipc", *judge_ipc(read(os.path.join(out, "ipc.md")), steps)))
    return results


def render(results):
    passed = all(ok for _, ok, _, _ in results)
    lines = [f"# GPU nightly: {'PASS' if passed else 'FAIL'}", "",
             "| step | verdict | why |", "|---|---|---|"]
    for step, ok, why, _ in results:
        text = "; ".join(why).replace("|", "/")
        lines.append(f"| {step} | {'pass' if ok else '**FAIL**'} | {text} |")
    lines += ["", "Reports: suite.txt, suite-lazy.txt, suite-cold.txt, faults.md (faults.log), faults-lazy.md, calibration.md (calibration.log), "
              "benchmarks.md (bench-log.txt, bench-compare.log, bench-*.json), ipc.md (ipc.log), machine.txt."]
    return passed, "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description="the GPU nightly's verdict")
    ap.add_argument("out")
    ap.add_argument("--known", help=f"known disagreements: lines `{KNOWN_FORM}`")
    a = ap.parse_args(argv)
    if not os.path.isdir(a.out):
        print(f"nightly_verdict: {a.out} is not a directory: give the folder `scripts/gpu.sh run` wrote "
              "its reports to (OUT)", file=sys.stderr)
        return 2
    known = {}
    if a.known:
        text = read(a.known)
        if text is None:
            print(f"nightly_verdict: cannot read {a.known}", file=sys.stderr)
            return 2
        try:
            known = read_known(text)
        except ValueError as e:
            print(f"nightly_verdict: {e}", file=sys.stderr)
            return 2
    results = verdict(a.out, known)
    passed, md = render(results)
    with open(os.path.join(a.out, "nightly.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "nightly.json"), "w") as f:
        json.dump({"pass": passed, "steps": [{"step": s, "pass": ok, "why": why, **d}
                                             for s, ok, why, d in results]}, f, indent=1)
        f.write("\n")
    sys.stdout.write(md)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
