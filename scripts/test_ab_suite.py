"""Tests of ab_suite.py with two fake suites (shell scripts)."""

import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def fake(folder, name, lines):
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write("#!/bin/sh\n")
        for line in lines:
            f.write(f"echo '{line}'\n")
    os.chmod(path, 0o755)
    return path


class AbSuite(unittest.TestCase):
    def test_table_ratios_and_verdict(self):
        with tempfile.TemporaryDirectory() as d:
            a = fake(d, "a", ["PASS    process:seed/shared   4.00 s  rank 0: HANG", "PASS    process:x   2.00 s"])
            b = fake(d, "b", ["PASS    process:seed/shared   2.00 s  rank 0: HANG", "FAIL    process:y   1.00 s"])
            out = os.path.join(d, "ab.md")
            p = subprocess.run(
                [sys.executable, os.path.join(HERE, "ab_suite.py"), a, b, "--rounds", "2", "--lanes", "eager", "--out", out],
                capture_output=True,
                text=True,
            )
            self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
            table = open(out).read()
            self.assertIn("| process:seed/shared | 4.00 [4.00-4.00] | 2.00 [2.00-2.00] | 0.50 | PASS,PASS | PASS,PASS |", table)
            self.assertIn("| process:x | 2.00 [2.00-2.00] | - | - | PASS,PASS | - |", table)
            self.assertIn("| process:y | - | 1.00 [1.00-1.00] | - | - | FAIL,FAIL |", table)
            self.assertIn("| jobs of both, summed | 4.00 [4.00-4.00] | 2.00 [2.00-2.00] | 0.50 | | |", table)

    def test_one_job_alone(self):
        with tempfile.TemporaryDirectory() as d:
            # Each fake prints, as the suite does for one job, its result after
            # the harness's words, with the scenario it was given and its
            # last argument.
            script = '#!/bin/sh\nfor a; do last=$a; done\necho "test every_scenario_on_nccl ... RESULT PASS 3.00 s; $DUPLEX_SCENARIO $last"\n'
            paths = []
            for name in "ab":
                path = os.path.join(d, name)
                with open(path, "w") as f:
                    f.write(script)
                os.chmod(path, 0o755)
                paths.append(path)
            out = os.path.join(d, "ab.md")
            logs = os.path.join(d, "logs")
            p = subprocess.run(
                [sys.executable, os.path.join(HERE, "ab_suite.py"), *paths, "--rounds", "3", "--lanes", "lazy",
                 "--job", "peer-dies", "--out", out, "--logs", logs],
                capture_output=True,
                text=True,
            )
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn("| process:peer-dies | 3.00 [3.00-3.00] | 3.00 [3.00-3.00] | 1.00 | PASS,PASS,PASS | PASS,PASS,PASS |",
                          open(out).read())
            self.assertIn("process:peer-dies every_scenario_on_nccl", open(os.path.join(logs, "lazy-A-0.txt")).read())

    def test_one_job_alone_that_fails_without_a_time_or_says_nothing(self):
        with tempfile.TemporaryDirectory() as d:
            a = os.path.join(d, "a")
            b = os.path.join(d, "b")
            with open(a, "w") as f:
                f.write('#!/bin/sh\necho "test every_scenario_on_nccl ... RESULT FAIL no free port: x"\n')
            with open(b, "w") as f:
                f.write("#!/bin/sh\nexit 3\n")
            for path in (a, b):
                os.chmod(path, 0o755)
            out = os.path.join(d, "ab.md")
            p = subprocess.run(
                [sys.executable, os.path.join(HERE, "ab_suite.py"), a, b, "--rounds", "1", "--lanes", "eager",
                 "--job", "peer-dies", "--out", out],
                capture_output=True,
                text=True,
            )
            self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
            row = [l for l in open(out).read().splitlines() if l.startswith("| process:peer-dies")]
            self.assertEqual(len(row), 1, row)
            self.assertTrue(row[0].endswith("| FAIL | FAIL |"), row)


if __name__ == "__main__":
    unittest.main()
