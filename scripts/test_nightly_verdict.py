"""Tests of nightly_verdict.py: each step's judgement on the reports the
GPU run writes, an earlier run's (scripts/testdata/: suite.txt,
calibration.md) and small fixtures (no GPU needed).

python3 -m unittest discover -s scripts -p 'test_*.py'
"""
import contextlib
import io
import json
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import nightly_verdict as nv  # noqa: E402



def committed(name):
    """A report of an earlier GPU run, kept as a fixture (scripts/testdata/),
    so that committing a new run's reports to docs/gpu/ changes no test."""
    with open(os.path.join(HERE, "testdata", name)) as f:
        return f.read()


UNAVAILABLE_ROW = ("| kernels-one-in-issue-order.sched | unavailable | 0.02 | ok "
                   "| not run: the run could not start with this launch (below) |\n")


def calibration():
    """The committed two-GPU calibration (37 examples) as a nightly would see
    it now: with the three-rank example that cannot start as a thread per
    rank on two GPUs (not run; the known list excuses it), which postdates
    that run. 36 of 38 agree."""
    text = committed("calibration.md")
    text = text.replace("| kernels-one.sched |", UNAVAILABLE_ROW + "| kernels-one.sched |", 1)
    return text.replace("36 of 37 examples agree.", "36 of 38 examples agree; 1 could not run with this launch.")


def known():
    with open(os.path.join(HERE, "nightly-known.txt")) as f:
        return nv.read_known(f.read())


SUITE_OK = """
running 1 test
test every_scenario_on_nccl ... PASS    seed/shared              6.23 s  6.04
rank 0 thread main: `synchronize` did not return within its deadline of 3s
PASS    seed/per-direction       3.45 s  3.23
PASS    unmatched-send           6.17 s  5.90
PASS    reuse-after-hang         7.98 s 
ran 4 scenarios on NCCL, each in its own process
ok

test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 1 filtered out; finished in 30.02s

"""

FAULTS_OK = """| case | mode | fault after (s) | rank 0 | rank 1 | result |
|---|---|---|---|---|---|
| kill-before | 2 processes | 1.2 | 4.1 s: RANK ERROR rank 1 failed: its process went silent | killed | PASS |
| freeze-during | 2 processes | 1.4 | 5.0 s: RANK ERROR rank 1 failed / stopped | killed | PASS |
| panic-local | local | 0.0 | 1.0 s: RANK ERROR rank 1 panicked | 1.0 s: RANK ERROR panicked | PASS |

3 of 3 cases passed (deadline 5s, grace 10s).

Produced by: scripts/gpu.sh run faults
"""


def ipc_table(where, trials=7):
    rows = "".join(f"| {fig} | 12.1 [10.8-18.7] |\n" for fig in nv.IPC_FIGURES)
    return f"### CUDA IPC between two processes ({where}), {trials} trials\n\n| figure | median [min-max] |\n|---|---|\n{rows}"


IPC_OK = ipc_table("GPU 0 and GPU 1, a process each") + "\n" + ipc_table("one GPU, two processes")


class Ipc(unittest.TestCase):
    STEPS = {"ipc": 0, "ipc-one-gpu": 0, "ipc-flags": 0, "ipc-flags-one-gpu": 0}

    def test_both_tables_with_every_figure_pass(self):
        ok, why, _ = nv.judge_ipc(IPC_OK, self.STEPS)
        self.assertTrue(ok, why)

    def test_the_committed_one_gpu_run_has_every_figure(self):
        with open(os.path.join(HERE, "..", "docs", "gpu", "ipc-1gpu.txt")) as f:
            one = f.read()
        ok, why, _ = nv.judge_ipc(ipc_table("GPU 0 and GPU 1, a process each") + one, self.STEPS)
        self.assertTrue(ok, why)

    def test_a_failed_probe_fails_it(self):
        ok, why, _ = nv.judge_ipc(IPC_OK, dict(self.STEPS, ipc=1))
        self.assertFalse(ok)
        self.assertEqual(why, ["ipc: exit status 1"])
        ok, why, _ = nv.judge_ipc(IPC_OK, dict(self.STEPS, **{"ipc-flags-one-gpu": 1}))
        self.assertEqual(why, ["ipc-flags-one-gpu: exit status 1"])
        ok, why, _ = nv.judge_ipc(IPC_OK, {"ipc": 0, "ipc-flags": 0, "ipc-flags-one-gpu": 0})
        self.assertEqual(why, ["ipc-one-gpu: did not run"])

    def test_a_missing_table_or_figure_fails_it(self):
        ok, why, _ = nv.judge_ipc(ipc_table("one GPU, two processes"), self.STEPS)
        self.assertEqual(why, ["ipc.md has no table for two GPUs"])
        ok, why, _ = nv.judge_ipc(IPC_OK.replace("| mem-open us | 12.1", "| mem-open us | -", 1), self.STEPS)
        self.assertEqual(why, ["two GPUs: `mem-open us` not measured"])
        ok, why, _ = nv.judge_ipc(None, self.STEPS)
        self.assertEqual(why, ["no ipc.md"])


class Steps(unittest.TestCase):
    def test_last_line_of_a_name_wins(self):
        self.assertEqual(nv.read_steps("suite 1\nbench 0\nsuite 0\nbuild staged\n"),
                         {"suite": 0, "bench": 0, "build": "staged"})

    def test_known_file_parses_and_rejects_bad_lines(self):
        k = known()
        self.assertEqual(sorted(k), [("calibrate", "kernels-one-in-issue-order.sched", "unavailable", "ok"),
                                     ("calibrate", "pytorch-seed.sched", "crash", "deadlock")])
        with self.assertRaises(ValueError):
            nv.read_known("calibrate pytorch-seed.sched  # no outcome")

    def test_a_known_line_without_the_checker_verdict_is_refused(self):
        with self.assertRaises(ValueError) as e:
            nv.read_known("calibrate pytorch-seed.sched crash  # the old form")
        self.assertIn("has 3 field(s), not 4: a line is `calibrate SUBJECT OUTCOME CHECKER  # reason`",
                      str(e.exception))
        self.assertIn("the checker's verdict is missing", str(e.exception))

    def test_build(self):
        self.assertTrue(nv.judge_build(0)[0])
        self.assertTrue(nv.judge_build("staged")[0])
        self.assertFalse(nv.judge_build(101)[0])
        self.assertFalse(nv.judge_build(None)[0])


class Suite(unittest.TestCase):
    def test_committed_run_fails_on_unmatched_send(self):
        ok, why, d = nv.judge_suite(committed("suite.txt"), 101)
        self.assertFalse(ok)
        self.assertEqual(d["scenarios"], 17)
        self.assertEqual(d["failed"], ["unmatched-send"])
        self.assertTrue(any("unmatched-send" in w for w in why))

    def test_a_clean_run_passes(self):
        ok, why, d = nv.judge_suite(SUITE_OK, 0)
        self.assertTrue(ok, why)
        self.assertEqual(d["scenarios"], 4)

    def test_exit_status_alone_fails_it(self):
        ok, why, _ = nv.judge_suite(SUITE_OK, 101)
        self.assertFalse(ok)
        ok, why, _ = nv.judge_suite(SUITE_OK.split("ran 4")[0], 124)
        self.assertFalse(ok)
        self.assertTrue(any("timed out" in w for w in why))

    def test_a_fail_line_fails_it_even_with_status_0(self):
        ok, _, d = nv.judge_suite(SUITE_OK.replace("PASS    seed/per", "FAIL    seed/per"), 0)
        self.assertFalse(ok)
        self.assertEqual(d["failed"], ["seed/per-direction"])

    def test_a_suite_that_ran_nothing_fails(self):
        text = "running 0 tests\n\ntest result: ok. 0 passed; 0 failed; 1 ignored\n"
        self.assertFalse(nv.judge_suite(text, 0)[0])
        self.assertFalse(nv.judge_suite("", None)[0])

    def test_a_suite_of_0_scenarios_fails(self):
        # The binary ran and said so, but judged nothing ("0 of 0").
        text = ("running 1 test\nran 0 scenarios on NCCL, each in its own process\nok\n\n"
                "test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 1 filtered out; finished in 0.10s\n")
        ok, why, d = nv.judge_suite(text, 0)
        self.assertFalse(ok, why)
        self.assertEqual(d["scenarios"], 0)
        self.assertIn("no scenario ran: a suite of 0 scenarios judges nothing", why)

    def test_a_missing_scenario_line_fails(self):
        ok, why, _ = nv.judge_suite(SUITE_OK.replace("PASS    unmatched-send           6.17 s  5.90\n", ""), 0)
        self.assertFalse(ok)
        self.assertTrue(any("ran 4" in w for w in why))


class Faults(unittest.TestCase):
    def test_all_cases_pass(self):
        ok, why, d = nv.judge_faults(FAULTS_OK, 0)
        self.assertTrue(ok, why)
        self.assertEqual(d["cases"], 3)

    def test_a_failing_case(self):
        text = FAULTS_OK.replace("| killed | PASS |", "| killed | FAIL: rank 0 took 30.0 s |", 1)
        text = text.replace("3 of 3 cases passed", "2 of 3 cases passed")
        ok, why, d = nv.judge_faults(text, 1)
        self.assertFalse(ok)
        self.assertEqual(d["failed"], ["kill-before"])

    def test_a_failing_row_fails_even_with_status_0(self):
        text = FAULTS_OK.replace("| killed | PASS |", "| killed | FAIL |", 1)
        self.assertFalse(nv.judge_faults(text, 0)[0])

    def test_no_report(self):
        self.assertFalse(nv.judge_faults(None, 124)[0])
        self.assertFalse(nv.judge_faults("\nProduced by: scripts/gpu.sh run faults\n", 0)[0])
        self.assertFalse(nv.judge_faults(None, None)[0])

    def test_summary_must_match_rows(self):
        text = FAULTS_OK.replace("3 of 3 cases passed", "4 of 4 cases passed")
        self.assertFalse(nv.judge_faults(text, 0)[0])


class Calibration(unittest.TestCase):
    def test_committed_run_passes_with_its_known_crash_only(self):
        text = calibration()
        ok, why, d = nv.judge_calibration(text, 1, known())
        self.assertTrue(ok, why)
        self.assertEqual(d["examples"], 38)
        self.assertEqual(d["disagree"], ["kernels-one-in-issue-order.sched", "pytorch-seed.sched"])
        self.assertTrue(any(w.startswith("known: pytorch-seed.sched (crash, checker deadlock)") for w in why))
        self.assertTrue(any(w.startswith("known: kernels-one-in-issue-order.sched (unavailable, checker ok)")
                            for w in why))
        # Without the known list it fails.
        self.assertFalse(nv.judge_calibration(text, 1, {})[0])

    def test_a_new_disagreement_fails(self):
        text = calibration().replace(
            "| seed.sched | deadlock | 5.53 | deadlock | yes |", "| seed.sched | ok | 5.53 | deadlock | NO |")
        text = text.replace("36 of 38 examples agree;", "35 of 38 examples agree;")
        ok, why, d = nv.judge_calibration(text, 1, known())
        self.assertFalse(ok)
        self.assertEqual(d["unknown"], ["seed.sched"])

    def test_known_example_with_another_outcome_fails(self):
        text = calibration().replace(
            "| pytorch-seed.sched | crash |", "| pytorch-seed.sched | ok |")
        self.assertFalse(nv.judge_calibration(text, 1, known())[0])

    def test_unavailable_or_timed_out(self):
        self.assertFalse(nv.judge_calibration("", 4, known())[0])
        self.assertFalse(nv.judge_calibration(None, 124, known())[0])
        self.assertFalse(nv.judge_calibration(calibration(), 124, known())[0])

    def test_status_and_table_must_agree(self):
        text = calibration()
        # Exit 0 with a disagreeing row in the table.
        self.assertFalse(nv.judge_calibration(text, 0, known())[0])
        clean = committed("calibration.md").replace(
            "| pytorch-seed.sched | crash | 2.46 | deadlock | no: NCCL failed instead of hanging (see below) |",
            "| pytorch-seed.sched | deadlock | 2.46 | deadlock | yes |")
        clean = clean.replace("36 of 37 examples agree.", "37 of 37 examples agree.")
        self.assertTrue(nv.judge_calibration(clean, 0, {})[0])
        # Exit 1 with nothing disagreeing.
        self.assertFalse(nv.judge_calibration(clean, 1, {})[0])

    def test_a_known_disagreement_that_no_longer_happens_fails(self):
        text = calibration()
        clean = text.replace("| pytorch-seed.sched | crash | 2.46 | deadlock | no: NCCL failed instead of hanging (see below) |",
                             "| pytorch-seed.sched | crash | 2.46 | deadlock | consistent: NCCL's error is explained by a mismatched setup |")
        clean = clean.replace("36 of 38 examples agree;", "37 of 38 examples agree;")
        ok, why, d = nv.judge_calibration(clean, 1, known())
        self.assertFalse(ok, why)
        self.assertEqual(d["stale"], ["pytorch-seed.sched"])
        self.assertTrue(any("no longer happen" in w and "pytorch-seed.sched" in w for w in why), why)
        # Without the entry the same table passes.
        k = known()
        del k[("calibrate", "pytorch-seed.sched", "crash", "deadlock")]
        self.assertTrue(nv.judge_calibration(clean, 1, k)[0])

    def test_a_known_crash_with_another_checker_verdict_fails(self):
        # The same crash, but the checker now says the program completes:
        # the regression calibration is there to catch, not the known
        # disagreement (which was against a predicted hang).
        text = calibration().replace(
            "| pytorch-seed.sched | crash | 2.46 | deadlock | no: NCCL failed instead of hanging (see below) |",
            "| pytorch-seed.sched | crash | 2.46 | ok | NO |")
        ok, why, d = nv.judge_calibration(text, 1, known())
        self.assertFalse(ok, why)
        self.assertEqual(d["unknown"], ["pytorch-seed.sched"])
        self.assertTrue(any("pytorch-seed.sched (real crash, checker ok)" in w for w in why), why)

    def test_a_known_line_whose_example_is_not_in_the_table_fails(self):
        # The two-GPU run of 2026-12-01 predates kernels-one-in-issue-order:
        # as far as the known list can tell, the example was renamed or
        # removed.
        ok, why, d = nv.judge_calibration(committed("calibration.md"), 1, known())
        self.assertFalse(ok, why)
        self.assertEqual(d["absent"], ["kernels-one-in-issue-order.sched"])
        self.assertTrue(any("name an example the calibration did not run: kernels-one-in-issue-order.sched" in w
                            for w in why), why)
        k = known()
        del k[("calibrate", "kernels-one-in-issue-order.sched", "unavailable", "ok")]
        self.assertTrue(nv.judge_calibration(committed("calibration.md"), 1, k)[0])

    def test_known_lines_of_steps_that_cannot_excuse_are_refused(self):
        with self.assertRaises(ValueError):
            nv.read_known("suite seed/shared FAIL  # the suite has no excuses")


class CalibrationNotRun(unittest.TestCase):
    TABLE = """| example | real outcome | time (s) | checker | agree |
|---|---|---|---|---|
| a.sched | ok | 1.00 | ok | yes |
| b.sched | unavailable | 0.20 | ok | not run: the run could not start with this launch (below) |

1 of 2 examples agree; 1 could not run with this launch.
"""

    def test_a_row_that_could_not_run_is_not_an_agreement(self):
        ok, why, d = nv.judge_calibration(self.TABLE, 1, {})
        self.assertFalse(ok, why)
        self.assertEqual(d["unknown"], ["b.sched"])
        # The summary line with its suffix is read, not refused.
        self.assertFalse(any("no `K of N" in w for w in why), why)
        self.assertFalse(any("but its table has" in w for w in why), why)
        known = {("calibrate", "b.sched", "unavailable", "ok"): "copy lanes across processes are gated"}
        self.assertTrue(nv.judge_calibration(self.TABLE, 1, known)[0])


class Whole(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.out = self.dir.name

    def tearDown(self):
        self.dir.cleanup()

    def write(self, name, text):
        with open(os.path.join(self.out, name), "w") as f:
            f.write(text)

    def good_run(self):
        self.write("steps.txt", "build 0\nsuite 0\nsuite-lazy 0\nsuite-cold 0\nfaults 0\nfaults-lazy 0\ncalibrate 1\nbench 0\n"
                   "bench-ctas-16 0\nbench-ctas-64 1\ncopylane 0\nbench-torch 0\nbench-table 0\nipc 0\nipc-one-gpu 0\nipc-flags 0\nipc-flags-one-gpu 0\n")
        self.write("ipc.md", IPC_OK)
        self.write("suite.txt", SUITE_OK)
        self.write("suite-lazy.txt", SUITE_OK)
        self.write("suite-cold.txt", SUITE_OK)
        self.write("faults.md", FAULTS_OK)
        self.write("faults-lazy.md", FAULTS_OK)
        self.write("calibration.md", calibration())
        fig = {"unit": "GB/s", "better": "higher", "trials": [1.0], "median": 1.0, "min": 1.0, "max": 1.0}
        self.write("bench-duplex.json", json.dumps({"format": 2, "figures": {"one_way/1MiB": fig}}))
        self.write("bench-torch.json", json.dumps({"format": 2, "figures": {"one_way/1MiB": fig}}))

    def main(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            rc = nv.main([self.out, "--known", os.path.join(HERE, "nightly-known.txt")])
        with open(os.path.join(self.out, "nightly.json")) as f:
            return rc, out.getvalue(), json.load(f)

    def test_no_such_directory_is_a_usage_error(self):
        err = io.StringIO()
        missing = os.path.join(self.out, "no", "such", "dir")
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            rc = nv.main([missing])
        self.assertEqual(rc, 2)
        self.assertIn(f"nightly_verdict: {missing} is not a directory", err.getvalue())

    def test_a_good_run_passes(self):
        self.good_run()
        rc, md, j = self.main()
        self.assertEqual(rc, 0, md)
        self.assertTrue(j["pass"])
        self.assertIn("# GPU nightly: PASS", md)
        self.assertIn("lane-settings sweep ctas-64: exit status 1 (not judged)", md)

    def test_a_benchmark_beyond_the_baseline_fails_it(self):
        self.good_run()
        self.write("steps.txt", "build 0\nsuite 0\nsuite-lazy 0\nsuite-cold 0\nfaults 0\nfaults-lazy 0\ncalibrate 1\nbench 0\ncopylane 0\nbench-torch 0\nbench-table 1\nipc 0\nipc-one-gpu 0\nipc-flags 0\nipc-flags-one-gpu 0\n")
        self.write("bench-compare.log", "bench_table: strict: 1 figure(s) regressed (every trial worse than "
                                        "the baseline's band): duplex:both_ways/256MiB\n")
        rc, md, j = self.main()
        self.assertEqual(rc, 1)
        self.assertEqual([s["step"] for s in j["steps"] if not s["pass"]], ["bench"])
        self.assertIn("duplex:both_ways/256MiB", md)

    def test_a_baseline_of_too_few_trials_is_said_and_passes(self):
        self.good_run()
        self.write("bench-compare.log", "bench_table: warning: the baseline has 24 figure(s) of fewer than 5 "
                                        "trials (...): replace it with a run of 5 trials or more on the GPUs: "
                                        "python3 scripts/bench_table.py ...\n")
        rc, md, j = self.main()
        self.assertEqual(rc, 0, md)
        self.assertIn("warning: the baseline has 24 figure(s) of fewer than 5 trials", md)

    def test_a_crash_of_the_comparison_is_not_called_a_regression(self):
        self.good_run()
        self.write("steps.txt", "build 0\nsuite 0\nsuite-lazy 0\nsuite-cold 0\nfaults 0\nfaults-lazy 0\ncalibrate 1\nbench 0\ncopylane 0\nbench-torch 0\nbench-table 1\nipc 0\nipc-one-gpu 0\nipc-flags 0\nipc-flags-one-gpu 0\n")
        self.write("bench-compare.log", "Traceback (most recent call last):\n  File \"bench_table.py\", line 80\n"
                                        "TypeError: float() argument must be a string or a real number, not 'NoneType'\n")
        rc, md, j = self.main()
        self.assertEqual(rc, 1)
        self.assertEqual([s["step"] for s in j["steps"] if not s["pass"]], ["bench"])
        self.assertIn("bench_table.py crashed (exit status 1, and no `bench_table: strict:` line): Traceback", md)
        self.assertIn("TypeError: float() argument", md)
        self.assertNotIn("worse", md.split("| bench |")[1].split("\n")[0])

    def test_a_failed_copy_lane_check_fails_it(self):
        self.good_run()
        self.write("steps.txt", "build 0\nsuite 0\nsuite-lazy 0\nsuite-cold 0\nfaults 0\nfaults-lazy 0\ncalibrate 1\nbench 0\ncopylane 1\nbench-torch 0\nbench-table 0\nipc 0\nipc-one-gpu 0\nipc-flags 0\nipc-flags-one-gpu 0\n")
        self.write("copylane.txt", "PASS data: ok\nFAIL abort: the abort did not release the stream in 2 s\n")
        rc, md, j = self.main()
        self.assertEqual(rc, 1)
        self.assertEqual([s["step"] for s in j["steps"] if not s["pass"]], ["bench"])
        self.assertIn("copylane: exit status 1: FAIL abort", md)
        self.write("steps.txt", "build 0\nsuite 0\nsuite-lazy 0\nsuite-cold 0\nfaults 0\nfaults-lazy 0\ncalibrate 1\nbench 0\nbench-torch 0\nbench-table 0\n")
        rc, md, _ = self.main()
        self.assertEqual(rc, 1)
        self.assertIn("copy-engine lane checks (copylane) did not run", md)

    def test_a_missing_torch_result_fails_it(self):
        self.good_run()
        os.remove(os.path.join(self.out, "bench-torch.json"))
        self.write("steps.txt", "build 0\nsuite 0\nsuite-lazy 0\nsuite-cold 0\nfaults 0\nfaults-lazy 0\ncalibrate 1\nbench 0\ncopylane 0\nbench-torch 1\nbench-table 1\n")
        rc, md, _ = self.main()
        self.assertEqual(rc, 1)
        self.assertIn("bench_torch.py: exit status 1", md)

    def test_a_failed_build_fails_everything_after_it(self):
        self.write("steps.txt", "build 101\n")
        rc, md, j = self.main()
        self.assertEqual(rc, 1)
        self.assertEqual([s["pass"] for s in j["steps"]], [False] * 9)
        self.assertIn("did not run", md)

    def test_old_format_bench_json_is_not_a_nightly_result(self):
        self.good_run()
        with open(os.path.join(HERE, "testdata", "bench-duplex-format1.json")) as f:
            self.write("bench-duplex.json", f.read())
        rc, md, _ = self.main()
        self.assertEqual(rc, 1)
        self.assertIn("bench-duplex.json is missing or not a format-2 result", md)



STUB_SUITE = """#!/bin/sh
# Each run's duplex environment, a line per run.
echo $(env | grep '^DUPLEX_' | sort) >> "$(dirname "$0")/stub/suite-env.txt"
cat "$(dirname "$0")/stub/suite.txt"; exit "$(cat "$(dirname "$0")/stub/suite.rc")"
"""
STUB_FAULTS = """#!/bin/sh
[ "$1" = drive ] && [ "$2" = --out ] || exit 2
cp "$(dirname "$0")/stub/faults.md" "$3"; echo "3 of 3 cases passed" >&2
exit "$(cat "$(dirname "$0")/stub/faults.rc")"
"""
STUB_DUPLEX = """#!/bin/sh
[ "$1" = calibrate ] || exit 2
echo "calibrating" >&2; cat "$(dirname "$0")/stub/calibration.md"
exit "$(cat "$(dirname "$0")/stub/calibrate.rc")"
"""
STUB_BENCH = """#!/usr/bin/env python3
import json, os, sys
a = sys.argv[1:]
d = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stub")
doc = json.load(open(os.path.join(d, "quick.json" if "--quick" in a else "duplex.json")))
# As bench does: the run's NCCL_* environment.
doc["env"] = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
json.dump(doc, open(a[a.index("--json") + 1], "w"))
print("bench stub")
sys.exit(int(open(os.path.join(d, "bench.rc")).read()))
"""
STUB_COPYLANE = """#!/bin/sh
d=$(dirname "$0")/stub
cat "$d/copylane.txt"; exit "$(cat "$d/copylane.rc")"
"""
STUB_IPC = """import os, sys
print(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".gpu", "stub",
                        "ipc-one.md" if "--one-gpu" in sys.argv else "ipc-two.md")).read())
"""
STUB_TORCH = """import os, shutil, sys
d = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stub")
rc = int(open(os.path.join(d, "torch.rc")).read())
if rc == 0:
    shutil.copy(os.path.join(d, "torch.json"), sys.argv[1])
print("Warning: [PG this line is filtered")
sys.exit(rc)
"""


@unittest.skipUnless(os.path.exists("/bin/bash"), "needs bash")
class EndToEnd(unittest.TestCase):
    """scripts/gpu.sh nightly with stub binaries in .gpu/ (NIGHTLY_BUILD=0):
    the plumbing from each command's exit status and report to the verdict."""

    def setUp(self):
        import shutil
        import subprocess
        import test_bench_table as tbt
        self.subprocess = subprocess
        self.dir = tempfile.TemporaryDirectory()
        root = self.root = self.dir.name
        os.makedirs(os.path.join(root, "scripts"))
        os.makedirs(os.path.join(root, "docs/gpu"))
        os.makedirs(os.path.join(root, ".gpu/stub"))
        os.makedirs(os.path.join(root, ".gpu/examples"))
        for f in ("gpu.sh", "gpu-nightly.sh", "nightly_verdict.py", "nightly-known.txt", "bench_table.py"):
            shutil.copy(os.path.join(HERE, f), os.path.join(root, "scripts", f))
        shutil.copy(os.path.join(HERE, "bench_table.py"), os.path.join(root, ".gpu"))
        with open(os.path.join(root, "scripts", "ipc_probe.py"), "w") as f:
            f.write(STUB_IPC)
        with open(os.path.join(root, "scripts", "ipc_flags_probe.py"), "w") as f:
            f.write("print('PASS X1 flag-release: stub')\n")
        for name, text in (("nccl-suite", STUB_SUITE), ("faults", STUB_FAULTS), ("duplex", STUB_DUPLEX),
                           ("bench", STUB_BENCH), ("bench_torch.py", STUB_TORCH),
                           ("copylane", STUB_COPYLANE)):
            path = os.path.join(root, ".gpu", name)
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, 0o755)
        quick = tbt.new_duplex({k: v for k, v in tbt.GOOD_DUPLEX.items() if k.endswith("256MiB")})
        quick["ctas"] = [64, 64]
        self.stub({"suite.txt": SUITE_OK, "suite.rc": "0", "faults.md": FAULTS_OK, "faults.rc": "0",
                   "calibration.md": calibration(), "calibrate.rc": "1",
                   "duplex.json": json.dumps(tbt.new_duplex(tbt.GOOD_DUPLEX)), "bench.rc": "0",
                   "quick.json": json.dumps(quick),
                   "torch.json": json.dumps(tbt.new_torch(tbt.GOOD_TORCH)), "torch.rc": "0",
                   "copylane.txt": "PASS data: stub\n", "copylane.rc": "0",
                   "ipc-two.md": ipc_table("GPU 0 and GPU 1, a process each"),
                   "ipc-one.md": ipc_table("one GPU, two processes")})
        # The committed baseline of this fake checkout: the stubs' own figures.
        subprocess.run([sys.executable, os.path.join(root, "scripts/bench_table.py"),
                        os.path.join(root, ".gpu/stub/duplex.json"), os.path.join(root, ".gpu/stub/torch.json"),
                        "--write-baseline", os.path.join(root, "docs/gpu/bench-baseline.json")],
                       check=True, capture_output=True)

    def tearDown(self):
        self.dir.cleanup()

    def stub(self, files):
        for name, text in files.items():
            with open(os.path.join(self.root, ".gpu/stub", name), "w") as f:
                f.write(text)

    def nightly(self, **extra):
        out = os.path.join(self.root, "reports")
        env = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
        env.update(NIGHTLY_BUILD="0", OUT=out, PATH="/usr/bin:/bin:" + os.path.dirname(sys.executable), **extra)
        p = self.subprocess.run(["bash", "scripts/gpu.sh", "nightly"], cwd=self.root, env=env,
                                capture_output=True, text=True, timeout=120)
        with open(os.path.join(out, "nightly.json")) as f:
            return p.returncode, p.stdout + p.stderr, json.load(f), out

    def failing(self, j):
        return [s["step"] for s in j["steps"] if not s["pass"]]

    def test_a_good_run_passes_and_writes_every_report(self):
        rc, log, j, out = self.nightly()
        self.assertEqual(rc, 0, log)
        self.assertEqual(self.failing(j), [])
        for name in ("steps.txt", "suite.txt", "faults.md", "calibration.md", "bench-duplex.json",
                     "bench-torch.json", "bench-ctas-64.json", "bench-env-4.json", "lanes.md", "benchmarks.md", "nightly.md", "machine.txt"):
            self.assertTrue(os.path.exists(os.path.join(out, name)), name)
        with open(os.path.join(out, "benchmarks.md")) as f:
            md = f.read()
        self.assertIn("within band", md)
        self.assertIn("| 64 | as the main run | – | – | 357.0 [355.0–359.0] |", md)
        # The lanes step: each NCCL environment of the sweep reached its
        # bench process (the stub answers every --quick run with CTAs 64),
        # named against the first run's, NCCL's defaults.
        with open(os.path.join(out, "lanes.md")) as f:
            lanes = f.read()
        self.assertIn("| 64 | as the first row |", lanes)
        self.assertIn("| 64 | NCCL_MAX_P2P_NCHANNELS=8 |", lanes)
        self.assertIn("| 64 | NCCL_BUFFSIZE=1048576, NCCL_MAX_P2P_NCHANNELS=8, NCCL_PROTO=Simple |", lanes)
        with open(os.path.join(out, "faults.md")) as f:
            self.assertIn("Produced by: scripts/gpu.sh run faults", f.read())
        with open(os.path.join(out, "bench-log.txt")) as f:
            self.assertNotIn("Warning: [PG", f.read())

    def test_the_nightly_unsets_what_shrinks_or_changes_the_matrix(self):
        shrink = {"DUPLEX_ONE_GPU": "1", "DUPLEX_LANES": "lazy", "DUPLEX_LANE_CONNECT": "one-way",
                  "DUPLEX_COLD": "1", "DUPLEX_IPC_COPY": "1", "DUPLEX_SCENARIO": "process:seed-rpc"}
        rc, log, j, out = self.nightly(**shrink)
        self.assertEqual(rc, 0, log)
        with open(os.path.join(self.root, ".gpu/stub/suite-env.txt")) as f:
            runs = f.read().splitlines()
        # suite, suite-lazy, suite-cold: each with only what gpu.sh gives it.
        self.assertEqual(runs, ["DUPLEX_TIMEOUT_MS=3000", "DUPLEX_LANES=lazy DUPLEX_TIMEOUT_MS=3000",
                                "DUPLEX_COLD=1 DUPLEX_TIMEOUT_MS=3000"])
        with open(os.path.join(out, "nightly.log")) as f:
            said = f.read()
        for v, was in shrink.items():
            self.assertIn(f"unset {v} (was '{was}')", said)

    def run_steps(self, *steps):
        out = tempfile.mkdtemp(dir=self.root)
        env = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
        env.update(OUT=out, PATH="/usr/bin:/bin:" + os.path.dirname(sys.executable))
        p = self.subprocess.run(["bash", "scripts/gpu.sh", "run", *steps], cwd=self.root, env=env,
                                capture_output=True, text=True, timeout=120)
        with open(os.path.join(out, "steps.txt")) as f:
            return p, nv.read_steps(f.read())

    def test_a_summary_grep_that_finds_nothing_does_not_end_the_run(self):
        # A suite that prints nothing: no RESULT line for ipc-copy's
        # summary, no PASS/FAIL line for one-gpu's; and a fault matrix that
        # writes no table. Each step is recorded as failed, and the run
        # goes on to the next.
        self.stub({"suite.txt": "", "suite.rc": "101", "faults.rc": "1"})
        os.remove(os.path.join(self.root, ".gpu/stub/faults.md"))
        p, steps = self.run_steps("ipc-copy", "calibrate")
        self.assertEqual((steps.get("ipc-copy"), steps.get("calibrate")), (1, 1), p.stdout + p.stderr)
        p, steps = self.run_steps("one-gpu", "calibrate")
        self.assertEqual((steps.get("suite-1gpu-eager"), steps.get("faults-1gpu-eager"), steps.get("calibrate")),
                         (101, 1, 1), p.stdout + p.stderr)

    def test_a_failing_suite_fails_the_nightly(self):
        self.stub({"suite.txt": committed("suite.txt"), "suite.rc": "101"})
        rc, log, j, _ = self.nightly()
        self.assertEqual(rc, 1, log)
        # The stub suite fails with eager and lazy lanes and cold alike.
        self.assertEqual(self.failing(j), ["suite", "suite-lazy", "suite-cold"])

    def test_a_failing_fault_case_fails_the_nightly(self):
        self.stub({"faults.md": FAULTS_OK.replace("| killed | PASS |", "| killed | FAIL: hung |", 1), "faults.rc": "1"})
        rc, _, j, _ = self.nightly()
        # The stub matrix fails with eager and with lazy lanes alike.
        self.assertEqual((rc, self.failing(j)), (1, ["faults", "faults-lazy"]))

    def test_a_calibration_disagreement_fails_the_nightly(self):
        self.stub({"calibration.md": calibration().replace(
            "| seed.sched | deadlock | 5.53 | deadlock | yes |", "| seed.sched | ok | 5.53 | deadlock | NO |")})
        rc, _, j, _ = self.nightly()
        self.assertEqual((rc, self.failing(j)), (1, ["calibrate"]))

    def test_a_benchmark_worse_than_the_baseline_fails_the_nightly(self):
        import test_bench_table as tbt
        worse = dict(tbt.GOOD_DUPLEX, **{"host_us": [9.0, 9.1, 9.2, 9.3, 9.4]})
        self.stub({"duplex.json": json.dumps(tbt.new_duplex(worse))})
        rc, _, j, out = self.nightly()
        self.assertEqual((rc, self.failing(j)), (1, ["bench"]))
        with open(os.path.join(out, "nightly.md")) as f:
            self.assertIn("duplex:host_us", f.read())

    def test_a_missing_baseline_fails_the_nightly(self):
        # No baseline is no comparison: the bench step fails, saying so,
        # rather than passing with nothing judged.
        os.remove(os.path.join(self.root, "docs/gpu/bench-baseline.json"))
        rc, log, j, out = self.nightly()
        self.assertEqual((rc, self.failing(j)), (1, ["bench"]), log)
        with open(os.path.join(out, "nightly.md")) as f:
            md = f.read()
        self.assertIn("the benchmark baseline could not be read, so no figure was judged", md)
        self.assertIn("docs/gpu/bench-baseline.json could not be read", md)

    def test_a_figure_without_baseline_fails_the_nightly(self):
        # The stubs' baseline lacks one figure the run takes: never judged.
        import test_bench_table as tbt
        fewer = {k: v for k, v in tbt.GOOD_DUPLEX.items() if k != "copy_latency_us"}
        path = os.path.join(self.root, ".gpu/stub/fewer.json")
        with open(path, "w") as f:
            json.dump(tbt.new_duplex(fewer), f)
        self.subprocess.run([sys.executable, os.path.join(self.root, "scripts/bench_table.py"), path,
                             os.path.join(self.root, ".gpu/stub/torch.json"), "--write-baseline",
                             os.path.join(self.root, "docs/gpu/bench-baseline.json")],
                            check=True, capture_output=True)
        rc, log, j, out = self.nightly()
        self.assertEqual((rc, self.failing(j)), (1, ["bench"]), log)
        with open(os.path.join(out, "nightly.md")) as f:
            md = f.read()
        self.assertIn("have no baseline, so they were not judged: duplex:copy_latency_us", md)
        self.assertIn(f"python3 scripts/bench_table.py {out}/bench-duplex.json {out}/bench-torch.json "
                      "--write-baseline docs/gpu/bench-baseline.json", md)

    def test_the_nightly_widens_the_band_by_5_percent(self):
        # BENCH_SLACK's default: every trial above the baseline's max (7.4
        # us), but within 5% of its median (7.2) past it: no regression.
        import test_bench_table as tbt
        drifted = dict(tbt.GOOD_DUPLEX, **{"latency_us": [7.5, 7.55, 7.6, 7.65, 7.7]})
        self.stub({"duplex.json": json.dumps(tbt.new_duplex(drifted))})
        rc, log, j, out = self.nightly()
        self.assertEqual((rc, self.failing(j)), (0, []), log)
        with open(os.path.join(out, "benchmarks.md")) as f:
            self.assertIn("| +5.6% | 6.64–7.76 ([min, max] ±5% of the median) | within band |", f.read())

    def test_a_baseline_of_one_trial_is_named_in_the_verdict(self):
        import test_bench_table as tbt
        one = os.path.join(self.root, ".gpu/stub/one.json")
        one_t = os.path.join(self.root, ".gpu/stub/one-torch.json")
        with open(one, "w") as f:
            json.dump(tbt.new_duplex({k: v[:1] for k, v in tbt.GOOD_DUPLEX.items()}), f)
        with open(one_t, "w") as f:
            json.dump(tbt.new_torch({k: v[:1] for k, v in tbt.GOOD_TORCH.items()}), f)
        self.subprocess.run([sys.executable, os.path.join(self.root, "scripts/bench_table.py"), one, one_t,
                             "--write-baseline", os.path.join(self.root, "docs/gpu/bench-baseline.json")],
                            check=True, capture_output=True)
        rc, log, j, out = self.nightly()
        self.assertEqual((rc, self.failing(j)), (0, []), log)
        with open(os.path.join(out, "nightly.md")) as f:
            self.assertIn("warning: the baseline has", f.read())

    def test_fewer_than_5_trials_is_refused(self):
        env = dict(os.environ, NIGHTLY_BUILD="0", OUT=os.path.join(self.root, "reports"), BENCH_TRIALS="3")
        p = self.subprocess.run(["bash", "scripts/gpu.sh", "nightly"], cwd=self.root, env=env,
                                capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("BENCH_TRIALS=3 is not a whole number of at least 5", p.stderr)

    def test_a_null_trial_is_not_measured_not_a_crash(self):
        # serde_json writes a NaN as null: that figure is not measured.
        import test_bench_table as tbt
        doc = tbt.new_duplex(tbt.GOOD_DUPLEX)
        doc["figures"]["host_us"]["trials"][2] = None
        self.stub({"duplex.json": json.dumps(doc)})
        rc, log, j, out = self.nightly()
        self.assertEqual((rc, self.failing(j)), (1, ["bench"]), log)
        with open(os.path.join(out, "nightly.md")) as f:
            self.assertIn("1 baseline figure(s) not measured in this run: duplex:host_us", f.read())
        with open(os.path.join(out, "benchmarks.md")) as f:
            self.assertIn("figure host_us not read (trial 3 of 5 is null, not a finite number)", f.read())

    def test_pytorch_failing_fails_the_nightly(self):
        self.stub({"torch.rc": "1"})
        rc, _, j, _ = self.nightly()
        self.assertEqual((rc, self.failing(j)), (1, ["bench"]))

    def test_no_staged_binaries_fails_the_build_step(self):
        os.remove(os.path.join(self.root, ".gpu/bench"))
        rc, _, j, _ = self.nightly()
        self.assertEqual(rc, 1)
        self.assertEqual(self.failing(j), ["build", "suite", "suite-lazy", "suite-cold", "faults", "faults-lazy", "calibrate", "bench",
                                           "ipc"])


def workflow_step(name):
    """The `run: |` script of the step `name` of the GPU nightly's workflow."""
    with open(os.path.join(HERE, "..", ".github", "workflows", "gpu-nightly.yml")) as f:
        lines = f.read().splitlines()
    at = next(i for i, l in enumerate(lines) if l.strip() == f"- name: {name}")
    run = next(i for i in range(at + 1, len(lines)) if lines[i].strip() == "run: |")
    indent = len(lines[run]) - len(lines[run].lstrip())
    body = []
    for l in lines[run + 1:]:
        if l.strip() and len(l) - len(l.lstrip()) <= indent:
            break
        body.append(l)
    return "\n".join(body) + "\n"


@unittest.skipUnless(os.path.exists("/bin/bash"), "needs bash")
class Workflow(unittest.TestCase):
    def test_the_workflow_refuses_fewer_than_5_trials(self):
        import subprocess
        script = workflow_step("Trials (at least 5)")
        for trials, ok in (("5", True), ("12", True), ("4", False), ("1", False), ("", False), ("five", False)):
            p = subprocess.run(["bash", "-e", "-c", script], env=dict(os.environ, BENCH_TRIALS=trials),
                               capture_output=True, text=True)
            self.assertEqual(p.returncode == 0, ok, (trials, p.stdout))
            if not ok:
                self.assertIn("::error::trials must be", p.stdout)



FAKE_CARGO = r"""#!/bin/sh
# cargo, as far as `scripts/gpu.sh build` uses it: `build` makes the
# binaries it stages; `test --no-run` answers from fake/test.json (stdout),
# fake/test.err (stderr) and fake/test.rc.
here=$(cd "$(dirname "$0")" && pwd)
case "$1" in
build)
  dir=${CARGO_TARGET_DIR:-target}
  mkdir -p "$dir/release/examples"
  for f in duplex examples/bench examples/faults examples/overhead examples/copylane; do
    : > "$dir/release/$f"
  done ;;
test)
  cat "$here/test.json"; cat "$here/test.err" >&2; exit "$(cat "$here/test.rc")" ;;
esac
"""


@unittest.skipUnless(os.path.exists("/bin/bash"), "needs bash")
class Build(unittest.TestCase):
    """scripts/gpu.sh build with a fake cargo on PATH."""

    def setUp(self):
        import shutil
        self.dir = tempfile.TemporaryDirectory()
        root = self.root = self.dir.name
        for d in ("scripts", "examples", "fake"):
            os.makedirs(os.path.join(root, d))
        for f in ("gpu.sh", "bench_torch.py", "bench_table.py"):
            shutil.copy(os.path.join(HERE, f), os.path.join(root, "scripts", f))
        self.put("fake/cargo", FAKE_CARGO)
        # strip leaves the fake (empty) binaries as they are.
        self.put("fake/strip", "#!/bin/sh\nexit 0\n")
        for f in ("cargo", "strip"):
            os.chmod(os.path.join(root, "fake", f), 0o755)

    def tearDown(self):
        self.dir.cleanup()

    def put(self, name, text):
        with open(os.path.join(self.root, name), "w") as f:
            f.write(text)

    def build(self, json_lines, err, rc):
        import subprocess
        self.put("fake/test.json", "".join(json.dumps(m) + "\n" for m in json_lines))
        self.put("fake/test.err", err)
        self.put("fake/test.rc", str(rc))
        env = dict(os.environ, PATH=os.path.join(self.root, "fake") + ":" + os.path.dirname(sys.executable)
                   + ":/usr/bin:/bin")
        return subprocess.run(["bash", "scripts/gpu.sh", "build"], cwd=self.root, env=env,
                              capture_output=True, text=True, timeout=60)

    def test_a_suite_that_does_not_compile_fails_with_its_errors_in_the_log(self):
        error = {"reason": "compiler-message", "message": {
            "rendered": "error[E0425]: cannot find value `x` in this scope\n --> tests/tests/nccl.rs:12:5\n"}}
        p = self.build([error, {"reason": "build-finished", "success": False}],
                       "error: could not compile `duplex-tests` (test \"nccl\") due to 1 previous error\n", 101)
        self.assertNotEqual(p.returncode, 0)
        log = p.stdout + p.stderr
        self.assertIn("error[E0425]: cannot find value `x` in this scope", log)
        self.assertIn("--> tests/tests/nccl.rs:12:5", log)
        self.assertIn("error: could not compile `duplex-tests`", log)
        self.assertIn("gpu.sh build: the GPU suite (tests/tests/nccl.rs) did not build", log)
        self.assertFalse(os.path.exists(os.path.join(self.root, ".gpu")))

    def test_a_build_stages_the_suite_binary_cargo_names(self):
        exe = os.path.join(self.root, "target/release/deps/nccl-0123")
        os.makedirs(os.path.dirname(exe))
        self.put("target/release/deps/nccl-0123", "the suite\n")
        self.put("scripts/bench_torch.py", "")
        artifact = {"reason": "compiler-artifact", "executable": exe, "target": {"name": "nccl"}}
        other = {"reason": "compiler-artifact", "executable": None, "target": {"name": "duplex"}}
        p = self.build([other, artifact, {"reason": "build-finished", "success": True}], "", 0)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        with open(os.path.join(self.root, ".gpu/nccl-suite")) as f:
            self.assertEqual(f.read(), "the suite\n")


if __name__ == "__main__":
    unittest.main()
