#!/usr/bin/env python3
"""Two builds of the GPU suite side by side: each job's wall time, A against B.

    scripts/ab_suite.py A_SUITE B_SUITE [--rounds N] [--lanes eager,lazy] [--out FILE]
                        [--job JOB]

Runs `SUITE --ignored --nocapture --test-threads=1` (the suite's process
jobs, with the environment it is given: DUPLEX_ONE_GPU=1 on a machine with
one GPU) for each lane mode, N rounds, the two builds alternating and the
first of each round switching, so that drift on a noisy machine falls on
both. With --job JOB (a process job, `peer-dies` say) each run is that job
alone (DUPLEX_SCENARIO=process:JOB, the test every_scenario_on_nccl), so
that many rounds of one job fit where a few of the whole suite would.
Each job's time is the one the suite prints (`PASS  process:JOB  T s`).
Writes a markdown table (per mode and job: each build's median [min-max] of
the rounds, the ratio B/A of the medians, and each build's verdicts) to
--out, and prints it. Exits 1 when any job of B failed.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

LINE = re.compile(r"^(PASS|FAIL)\s+(\S+)\s+([0-9.]+) s")
# A job run alone (--job) says `RESULT PASS|FAIL T s; ...`, on the line
# where the test harness wrote `test every_scenario_on_nccl ... `; a
# failure may come without the time (`RESULT FAIL no free port`).
ALONE = re.compile(r"RESULT (PASS|FAIL)(?: ([0-9.]+) s)?")


def run_suite(binary, lanes, limit, job=None):
    env = dict(os.environ, DUPLEX_LANES=lanes)
    env.setdefault("DUPLEX_TIMEOUT_MS", "5000")
    argv = [binary, "--ignored", "--nocapture", "--test-threads=1"]
    if job:
        env["DUPLEX_SCENARIO"] = f"process:{job}"
        argv.append("every_scenario_on_nccl")
    start = time.monotonic()
    try:
        p = subprocess.run(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=limit,
        )
        text = p.stdout
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += f"\n(timed out after {limit} s)\n"
    jobs = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            jobs[m.group(2)] = (m.group(1), float(m.group(3)))
        m = ALONE.search(line)
        if m and job:
            took = float(m.group(2)) if m.group(2) else time.monotonic() - start
            jobs[f"process:{job}"] = (m.group(1), took)
    wall = time.monotonic() - start
    # A job alone that said nothing (a crash, the time limit) failed.
    if job and f"process:{job}" not in jobs:
        jobs[f"process:{job}"] = ("FAIL", wall)
    return jobs, wall, text


def spread(xs):
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lanes", default="eager,lazy")
    ap.add_argument("--limit", type=int, default=150)
    ap.add_argument("--out", default="ab.md")
    ap.add_argument("--logs", default=None, help="a folder for each run's output")
    ap.add_argument("--job", default=None, help="one process job alone, each round")
    args = ap.parse_args()
    modes = [m for m in args.lanes.split(",") if m]
    # times[mode][build][job] = [seconds...]; verdicts likewise
    times = {m: {"A": {}, "B": {}} for m in modes}
    verdicts = {m: {"A": {}, "B": {}} for m in modes}
    totals = {m: {"A": [], "B": []} for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            order = ["A", "B"] if r % 2 == 0 else ["B", "A"]
            for build in order:
                binary = args.a if build == "A" else args.b
                jobs, wall, text = run_suite(binary, mode, args.limit, args.job)
                if args.logs:
                    os.makedirs(args.logs, exist_ok=True)
                    with open(os.path.join(args.logs, f"{mode}-{build}-{r}.txt"), "w") as f:
                        f.write(text)
                totals[mode][build].append(wall)
                for job, (v, t) in jobs.items():
                    times[mode][build].setdefault(job, []).append(t)
                    verdicts[mode][build].setdefault(job, []).append(v)
                print(f"round {r} {mode} {build}: {len(jobs)} jobs in {wall:.1f} s", flush=True)
    out = [
        f"# The suite's jobs, build A ({args.a}) against build B ({args.b})",
        "",
        f"{args.rounds} rounds, builds alternating (the first switching each round); "
        "seconds per job as the suite prints them: median [min-max]; B/A of the medians.",
        "",
    ]
    failed_b = False
    for mode in modes:
        out += [f"## DUPLEX_LANES={mode}", "", "| job | A s | B s | B/A | A | B |", "|---|---|---|---|---|---|"]
        jobs = sorted(set(times[mode]["A"]) | set(times[mode]["B"]))
        for job in jobs:
            a = times[mode]["A"].get(job, [])
            b = times[mode]["B"].get(job, [])
            ratio = f"{statistics.median(b) / statistics.median(a):.2f}" if a and b else "-"
            va = ",".join(verdicts[mode]["A"].get(job, [])) or "-"
            vb = ",".join(verdicts[mode]["B"].get(job, [])) or "-"
            failed_b |= "FAIL" in vb
            out.append(f"| {job} | {spread(a)} | {spread(b)} | {ratio} | {va} | {vb} |")
        # Per round, the sum over the jobs both builds ran.
        both = [j for j in jobs if j in times[mode]["A"] and j in times[mode]["B"]]
        a_sum, b_sum = ([sum(t) for t in zip(*[times[mode][x][j] for j in both])] for x in "AB")
        if a_sum and b_sum:
            out.append(
                f"| jobs of both, summed | {spread(a_sum)} | {spread(b_sum)} | "
                f"{statistics.median(b_sum) / statistics.median(a_sum):.2f} | | |"
            )
        out.append("")
        out.append(f"whole runs (with start-up): A {spread(totals[mode]['A'])} s, B {spread(totals[mode]['B'])} s")
        out.append("")
    text = "\n".join(out)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print(text)
    sys.exit(1 if failed_b else 0)


if __name__ == "__main__":
    main()
