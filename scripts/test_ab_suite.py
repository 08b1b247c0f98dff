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


if __name__ == "__main__":
    unittest.main()
