"""Tests of bench_table.py's loading, comparison, targets and command line,
on small fixture JSONs (no GPU needed).

python3 -m unittest discover -s scripts -p 'test_*.py'
(or, from scripts/: python3 -m unittest test_bench_table)
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
import bench_table as bt  # noqa: E402

REPO = os.path.dirname(HERE)

MiB = 1 << 20


def new_duplex(trials):
    """A format-2 duplex result: figure name -> trial values."""
    figs = {}
    for name, values in trials.items():
        if "/" in name and name.split("/")[0].endswith(("one_way", "both_ways")):
            unit, better = "GB/s", "higher"
            nbytes = int(name.split("/")[1].replace("MiB", "")) * MiB
        elif name.startswith("lane_bytes"):
            unit, better, nbytes = "B", "lower", None
        elif name.startswith("lane_create"):
            unit, better, nbytes = "ms", "lower", None
        else:
            unit, better, nbytes = "us", "lower", None
        figs[name] = bt.make_figure(unit, better, values, nbytes)
    return {"format": 2, "bench": "duplex", "nccl": "2.28.3", "ctas": [None, None],
            "trials": 5, "quick": False, "figures": figs, "lanes": []}


def new_torch(trials):
    figs = {}
    for name, values in trials.items():
        if name == "latency_us":
            figs[name] = bt.make_figure("us", "lower", values)
        else:
            figs[name] = bt.make_figure("GB/s", "higher", values,
                                        int(name.split("/")[1].replace("MiB", "")) * MiB)
    return {"format": 2, "bench": "torch", "torch": "2.11.0", "nccl": "2.28.9",
            "trials": 5, "figures": figs}


OLD_DUPLEX = {
    "nccl": "2.28.3", "ctas": [None, None],
    "one_way": [[MiB, 72.5], [64 * MiB, 335.5], [256 * MiB, 357.4]],
    "both_ways": [[MiB, 35.1], [64 * MiB, 309.1], [256 * MiB, 352.0]],
    "latency_duplex_us": 13.66, "latency_raw_us": 8.47,
    "host_duplex_us": 10.44, "host_raw_us": 6.53,
    "lanes": [{"name": "lane:0->1", "create_ms": 35.6, "bytes": 207618048,
               "measured_by": "free device memory before and after"}],
}
OLD_TORCH = {"torch": "2.11.0+cu130", "nccl": "2.28.9",
             "one_way": [[MiB, 37.8], [64 * MiB, 332.3], [256 * MiB, 356.6]],
             "batch": [[MiB, 22.2], [64 * MiB, 268.5], [256 * MiB, 301.0]],
             "two_pgs": [[MiB, 14.3], [64 * MiB, 299.0], [256 * MiB, 342.0]],
             "latency_us": 36.2}

# A full new-format run whose every target is met.
GOOD_DUPLEX = {
    "one_way/1MiB": [70, 71, 72, 73, 74], "raw_one_way/1MiB": [70, 71, 72, 73, 74],
    "one_way/64MiB": [330, 332, 334, 336, 338], "raw_one_way/64MiB": [331, 333, 334, 335, 337],
    "one_way/256MiB": [355, 356, 357, 358, 359], "raw_one_way/256MiB": [356, 356, 357, 358, 358],
    "both_ways/1MiB": [35, 36, 37, 38, 39], "raw_both_ways/1MiB": [35, 36, 37, 38, 39],
    "both_ways/64MiB": [325, 326, 327, 328, 329], "raw_both_ways/64MiB": [325, 326, 327, 328, 329],
    "both_ways/256MiB": [350, 351, 352, 353, 354], "raw_both_ways/256MiB": [350, 351, 352, 353, 354],
    "latency_us": [7.0, 7.1, 7.2, 7.3, 7.4], "raw_latency_us": [6.5, 6.6, 6.7, 6.8, 6.9],
    "host_us": [6.5, 6.6, 6.7, 6.8, 6.9], "raw_host_us": [6.0, 6.1, 6.2, 6.3, 6.4],
    "lane_latency_us": [7.0, 7.1, 7.2, 7.3, 7.4], "copy_latency_us": [7.1, 7.2, 7.3, 7.4, 7.5],
    "lane_create_ms/lane:0->1": [30, 31, 32, 33, 34], "lane_bytes/lane:0->1": [207618048] * 5,
    "copy_both_ways/256MiB": [372, 373, 374, 375, 376], "ce_one_way/256MiB": [381, 382, 383, 384, 385],
}
GOOD_TORCH = {
    "one_way/1MiB": [37, 38, 39, 40, 41], "one_way/64MiB": [330, 331, 332, 333, 334],
    "one_way/256MiB": [355, 356, 357, 358, 359],
    "batch/1MiB": [22, 23, 24, 25, 26], "batch/64MiB": [265, 266, 267, 268, 269],
    "batch/256MiB": [300, 301, 302, 303, 304],
    "two_pgs/1MiB": [14, 15, 16, 17, 18], "two_pgs/64MiB": [295, 296, 297, 298, 299],
    "two_pgs/256MiB": [340, 341, 342, 343, 344],
    "latency_us": [36, 37, 38, 39, 40],
}


class Files:
    """Fixture files in a temporary directory."""

    def __init__(self):
        self.dir = tempfile.TemporaryDirectory()

    def write(self, name, doc):
        path = os.path.join(self.dir.name, name)
        with open(path, "w") as f:
            json.dump(doc, f)
        return path

    def path(self, name):
        return os.path.join(self.dir.name, name)

    def close(self):
        self.dir.cleanup()


def run_main(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = bt.main(argv)
    return rc, out.getvalue(), err.getvalue()


class Loading(unittest.TestCase):
    def test_old_duplex_format_is_one_trial_per_figure(self):
        bench, meta, figs = bt.parse_run(OLD_DUPLEX)
        self.assertEqual(bench, "duplex")
        self.assertEqual(meta["trials"], 1)
        f = figs["both_ways/256MiB"]
        self.assertEqual((f["trials"], f["median"], f["min"], f["max"]), ([352.0], 352.0, 352.0, 352.0))
        self.assertEqual(f["better"], "higher")
        self.assertEqual(f["bytes"], 256 * MiB)
        self.assertEqual(figs["latency_us"]["median"], 13.66)
        self.assertEqual(figs["raw_latency_us"]["median"], 8.47)
        self.assertEqual(figs["host_us"]["median"], 10.44)
        self.assertEqual(figs["raw_host_us"]["better"], "lower")
        self.assertEqual(figs["lane_bytes/lane:0->1"]["median"], 207618048)
        self.assertEqual(figs["lane_create_ms/lane:0->1"]["unit"], "ms")
        self.assertNotIn("raw_one_way/256MiB", figs)

    def test_old_torch_format(self):
        bench, _, figs = bt.parse_run(OLD_TORCH)
        self.assertEqual(bench, "torch")
        self.assertEqual(sorted(figs), sorted(
            [f"{k}/{s}" for k in ("one_way", "batch", "two_pgs") for s in ("1MiB", "64MiB", "256MiB")]
            + ["latency_us"]))
        self.assertEqual(figs["two_pgs/256MiB"]["trials"], [342.0])

    def test_new_format_summary_is_recomputed_from_trials(self):
        d = new_duplex({"one_way/256MiB": [1, 3, 2, 5, 4]})
        d["figures"]["one_way/256MiB"]["median"] = 99  # a stale summary
        _, _, figs = bt.parse_run(d)
        f = figs["one_way/256MiB"]
        self.assertEqual((f["median"], f["min"], f["max"]), (3, 1, 5))

    def test_even_trial_count_median_is_mean_of_middle_two(self):
        self.assertEqual(bt.make_figure("us", "lower", [4, 1, 3, 2])["median"], 2.5)

    def test_size_names_match_duplex_size(self):
        self.assertEqual([bt.size_name(b) for b in (MiB, 64 * MiB, 256 * MiB, 4096, 1 << 30, 1000)],
                         ["1MiB", "64MiB", "256MiB", "4KiB", "1GiB", "1000B"])

    def test_a_figure_that_cannot_be_judged_is_refused_with_a_reason(self):
        good = {"unit": "us", "better": "lower", "trials": [1.0, 2.0, 3.0]}
        for change, why in (({"trials": [1.0, None, 3.0]}, "trial 2 of 3 is null, not a finite number"),
                            ({"trials": [1.0, "fast"]}, 'trial 2 of 2 is "fast", not a finite number'),
                            ({"trials": [float("nan")]}, "trial 1 of 1 is NaN, not a finite number"),
                            ({"trials": [float("inf"), 1.0]}, "trial 1 of 2 is Infinity, not a finite number"),
                            ({"trials": [True]}, "trial 1 of 1 is true, not a finite number"),
                            ({"trials": "1.0"}, 'its trials are "1.0", not a list'),
                            ({"trials": [], "median": None}, "its median is null, not a finite number"),
                            ({"better": "faster"}, 'its `better` is "faster", not "higher" or "lower"')):
            with self.assertRaises(ValueError) as e:
                bt.normalize_figure(dict(good, **change))
            self.assertEqual(str(e.exception), why)
        with self.assertRaises(ValueError) as e:
            bt.normalize_figure({"unit": "us", "better": "lower"})
        self.assertEqual(str(e.exception), "it has neither trials nor a median")
        with self.assertRaises(ValueError):
            bt.normalize_figure(None)
        # A run: the bad figure is named and left out, the rest are read.
        d = new_duplex({"one_way/256MiB": [1, 2, 3], "host_us": [1, 2, 3]})
        d["figures"]["host_us"]["trials"][1] = None
        bad = []
        _, _, figs = bt.parse_run(d, bad)
        self.assertEqual((sorted(figs), bad), (["one_way/256MiB"], [("host_us", "trial 2 of 3 is null, not a finite number")]))
        with self.assertRaises(ValueError):
            bt.parse_run(d)
        with self.assertRaises(ValueError):
            bt.parse_run(dict(OLD_DUPLEX, one_way=[[MiB, None]]))

    def test_which_way_is_better_comes_from_the_unit_when_unsaid(self):
        for unit, better in (("GB/s", "higher"), ("us", "lower"), ("ms", "lower"), ("B", "lower")):
            self.assertEqual(bt.normalize_figure({"unit": unit, "trials": [1.0]})["better"], better, unit)
            self.assertEqual(bt.normalize_figure({"unit": unit, "median": 1.0})["better"], better, unit)
        # Said outright, it stands.
        self.assertEqual(bt.normalize_figure({"unit": "us", "better": "higher", "trials": [1.0]})["better"], "higher")
        with self.assertRaises(ValueError) as e:
            bt.normalize_figure({"unit": "furlongs", "trials": [1.0]})
        self.assertIn('its unit "furlongs" does not either', str(e.exception))

    def test_not_a_benchmark(self):
        with self.assertRaises(ValueError):
            bt.parse_run({"something": 1})

    def test_committed_baseline_is_the_old_run_unchanged(self):
        base = bt.parse_baseline(bt.load_json(os.path.join(REPO, "docs/gpu/bench-baseline.json")))
        old = {}
        for name in ("bench-duplex.json", "bench-torch.json"):
            bench, _, figs = bt.parse_run(bt.load_json(os.path.join(REPO, "docs/gpu", name)))
            old.update(bt.prefixed(bench, figs))
        self.assertEqual(set(base), set(old))
        for k in old:
            self.assertEqual(base[k]["trials"], old[k]["trials"], k)
            self.assertEqual(base[k]["median"], old[k]["median"], k)


class Comparing(unittest.TestCase):
    def base(self):
        return bt.prefixed("duplex", bt.parse_run(new_duplex({
            "one_way/256MiB": [350, 352, 355, 357, 360],
            "latency_us": [10.0, 10.2, 10.5, 10.7, 11.0],
            "host_us": [10.0, 10.1, 10.2, 10.3, 10.4],
        }))[2])

    def verdicts(self, now, **kw):
        # Without slack unless a test asks: these test the band's edges.
        kw.setdefault("slack", 0)
        cur = bt.prefixed("duplex", bt.parse_run(new_duplex(now))[2])
        return {r["name"]: r["verdict"] for r in bt.compare(cur, self.base(), **kw)}

    def test_within_the_spread(self):
        v = self.verdicts({"one_way/256MiB": [349, 350, 351, 352, 353],
                           "latency_us": [10.5] * 5, "host_us": [10.4] * 5})
        self.assertEqual(set(v.values()), {bt.WITHIN})

    def test_bandwidth_below_min_is_worse_above_max_better(self):
        v = self.verdicts({"one_way/256MiB": [340, 341, 342, 343, 359]})
        self.assertEqual(v["duplex:one_way/256MiB"], bt.WORSE)
        v = self.verdicts({"one_way/256MiB": [361, 362, 363, 364, 365]})
        self.assertEqual(v["duplex:one_way/256MiB"], bt.BETTER)

    def test_latency_above_max_is_worse_below_min_better(self):
        v = self.verdicts({"latency_us": [11.1, 11.2, 11.3, 11.4, 11.5], "host_us": [9.0] * 5})
        self.assertEqual(v["duplex:latency_us"], bt.WORSE)
        self.assertEqual(v["duplex:host_us"], bt.BETTER)

    def test_the_median_decides_not_single_trials(self):
        v = self.verdicts({"one_way/256MiB": [300, 301, 355, 400, 401]})
        self.assertEqual(v["duplex:one_way/256MiB"], bt.WITHIN)

    def test_missing_and_new_figures(self):
        v = self.verdicts({"one_way/256MiB": [355] * 5, "raw_one_way/256MiB": [356] * 5})
        self.assertEqual(v["duplex:latency_us"], bt.MISSING)
        self.assertEqual(v["duplex:raw_one_way/256MiB"], bt.NEW)

    def test_slack_widens_the_band(self):
        now = {"one_way/256MiB": [348] * 5}
        self.assertEqual(self.verdicts(now)["duplex:one_way/256MiB"], bt.WORSE)
        self.assertEqual(self.verdicts(now, slack=0.01)["duplex:one_way/256MiB"], bt.WITHIN)

    def test_the_default_slack_is_5_percent_of_the_median(self):
        # Base [350, 360], median 355: the band reaches 17.75 past each end.
        self.assertEqual(bt.DEFAULT_SLACK, 0.05)
        cur = lambda v: bt.prefixed("duplex", bt.parse_run(new_duplex({"one_way/256MiB": v}))[2])
        row = {r["name"]: r for r in bt.compare(cur([333] * 5), self.base())}["duplex:one_way/256MiB"]
        self.assertEqual(row["verdict"], bt.WITHIN)
        self.assertAlmostEqual(row["band"][0], 350 - 17.75)
        self.assertEqual(row["band"][2], "[min, max] ±5% of the median")
        row = {r["name"]: r for r in bt.compare(cur([332] * 5), self.base())}["duplex:one_way/256MiB"]
        self.assertEqual(row["verdict"], bt.WORSE)

    def test_one_trial_baseline_uses_the_tolerance(self):
        base = bt.prefixed("duplex", bt.parse_run(OLD_DUPLEX)[2])

        def verdict(values, **kw):
            cur = bt.prefixed("duplex", bt.parse_run(new_duplex({"both_ways/256MiB": values}))[2])
            return {r["name"]: r for r in bt.compare(cur, base, **kw)}["duplex:both_ways/256MiB"]

        # 352.0 in the old run; the re-run saw 321.9 (-8.6%).
        self.assertEqual(verdict([321.9] * 5)["verdict"], bt.WITHIN)
        self.assertEqual(verdict([316.0] * 5)["verdict"], bt.WORSE)   # -10.2%
        self.assertEqual(verdict([388.0] * 5)["verdict"], bt.BETTER)  # +10.2%
        self.assertEqual(verdict([330.0] * 5, tolerance=0.05)["verdict"], bt.WORSE)
        r = verdict([321.9] * 5)
        self.assertIn("one trial", r["band"][2])
        self.assertAlmostEqual(r["change"], 321.9 / 352.0 - 1)

    def test_strict_fails_a_regression_not_a_median_outside_the_band(self):
        def failures(values):
            v = bt.compare(
                bt.prefixed("duplex", bt.parse_run(new_duplex({"one_way/256MiB": values,
                                                               "latency_us": [10.5] * 5,
                                                               "host_us": [10.4] * 5}))[2]),
                self.base(), slack=0)
            return [r["name"] for r in bt.strict_failures(v)], {r["name"]: r["verdict"] for r in v}
        # The median is below the band, but the best trial is inside it:
        # flagged, not failed.
        names, verdicts = failures([340, 341, 342, 343, 359])
        self.assertEqual(verdicts["duplex:one_way/256MiB"], bt.WORSE)
        self.assertEqual(names, [])
        # Every trial is below the band: a regression.
        names, _ = failures([340, 341, 342, 343, 344])
        self.assertEqual(names, ["duplex:one_way/256MiB"])

    def test_strict_failures_are_worse_and_missing(self):
        v = bt.compare(
            bt.prefixed("duplex", bt.parse_run(new_duplex({"one_way/256MiB": [300] * 5,
                                                           "host_us": [9.0] * 5}))[2]),
            self.base())
        self.assertEqual(sorted(r["name"] for r in bt.strict_failures(v)),
                         ["duplex:latency_us", "duplex:one_way/256MiB"])


class Targets(unittest.TestCase):
    def figs(self, d, t):
        f = bt.prefixed("duplex", bt.parse_run(new_duplex(d))[2])
        f.update(bt.prefixed("torch", bt.parse_run(new_torch(t))[2]))
        return f

    def test_all_met(self):
        rows = bt.targets(self.figs(GOOD_DUPLEX, GOOD_TORCH))
        self.assertEqual(len(rows), 12)
        self.assertTrue(all(met is True for _, met, _ in rows), rows)

    def test_each_target_can_fail(self):
        d = dict(GOOD_DUPLEX)
        d["both_ways/256MiB"] = [340] * 5      # < 0.97 x 357 = 346.3, < PyTorch's 342
        d["both_ways/64MiB"] = [322] * 5       # < 0.97 x 334 = 324.0, > PyTorch's 297
        d["one_way/1MiB"] = [70] * 5           # < 0.99 x 72
        d["latency_us"] = [7.8] * 5            # +1.1 us
        d["host_us"] = [10.2] * 5              # +4 us
        d["copy_both_ways/256MiB"] = [369] * 5  # < 1.08 x 342 = 369.4, < 0.97 x 383 = 371.5
        d["copy_latency_us"] = [7.6] * 5        # > 1.05 x 7.2 = 7.56
        met = {text: m for text, m, _ in bt.targets(self.figs(d, GOOD_TORCH))}
        nccl = {text: m for text, m in met.items() if "copy-engine" not in text}
        by = lambda *words: [m for text, m in nccl.items() if all(w in text for w in words)]
        self.assertEqual(by("256 MiB", "0.97"), [False])
        self.assertEqual(by("256 MiB", "PyTorch"), [False])
        self.assertEqual(by("64 MiB", "0.97"), [False])
        self.assertEqual(by("64 MiB", "PyTorch"), [True])
        self.assertEqual(by("1 MiB", "raw"), [False])
        self.assertEqual(by("256 MiB", "raw"), [True])
        self.assertEqual(by("4 KiB"), [False])
        self.assertEqual(by("host"), [False])
        copy = [m for text, m in met.items() if "copy-engine" in text]
        self.assertEqual(copy, [False, False, False])

    def test_boundaries_are_met(self):
        d = dict(GOOD_DUPLEX)
        d["latency_us"] = [7.7] * 5             # raw 6.7: exactly +1.0 us
        d["both_ways/256MiB"] = [342.0] * 5     # PyTorch's best two_pgs median 342
        met = {text: m for text, m, _ in bt.targets(self.figs(d, GOOD_TORCH))}
        self.assertTrue(all(m for t, m in met.items() if "4 KiB" in t))
        self.assertTrue(all(m for t, m in met.items() if "256 MiB" in t and "PyTorch" in t))

    def test_old_format_has_no_raw_bandwidth(self):
        f = bt.prefixed("duplex", bt.parse_run(OLD_DUPLEX)[2])
        f.update(bt.prefixed("torch", bt.parse_run(OLD_TORCH)[2]))
        rows = {text: (m, v) for text, m, v in bt.targets(f)}
        raw = [r for t, r in rows.items() if "raw NCCL (≥" in t]
        self.assertEqual(raw, [(None, "not measured")] * 3)
        lat = [r for t, r in rows.items() if "4 KiB half round trip" in t][0]
        self.assertEqual(lat[0], False)
        self.assertIn("+5.19 µs", lat[1])

    def test_without_torch_the_torch_targets_are_not_measured(self):
        f = bt.prefixed("duplex", bt.parse_run(new_duplex(GOOD_DUPLEX))[2])
        rows = {text: m for text, m, _ in bt.targets(f)}
        self.assertEqual([m for t, m in rows.items() if "PyTorch" in t], [None, None, None])


class CommandLine(unittest.TestCase):
    def setUp(self):
        self.files = Files()
        self.duplex = self.files.write("duplex.json", new_duplex(GOOD_DUPLEX))
        self.torch = self.files.write("torch.json", new_torch(GOOD_TORCH))

    def tearDown(self):
        self.files.close()

    def test_table_shows_median_min_max(self):
        rc, out, _ = run_main([self.duplex, self.torch])
        self.assertEqual(rc, 0)
        self.assertIn("| 256 MiB | 357.0 [355.0–359.0] | 357.0 [356.0–358.0] | 357.0 [355.0–359.0] |", out)
        self.assertIn("7.20 [7.00–7.40]", out)
        self.assertIn("| lane:0->1 | 32.0 [30.0–34.0] | 198.0 [198.0–198.0] |", out)
        self.assertNotIn("1.1×", out)
        self.assertNotIn("Compared with the baseline", out)

    def test_copy_engine_lanes_and_the_measured_threshold(self):
        doc = new_duplex(GOOD_DUPLEX)
        row = lambda b, n, c: {"bytes": b, "nccl_one_way": n, "copy_one_way": c,
                               "nccl_both_ways": n, "copy_both_ways": c}
        doc["copy_threshold"] = {"trials": 5, "copy_from": 4 * MiB,
                                 "sizes": [row(MiB, 10.0, 12.0), row(4 * MiB, 30.0, 25.0)]}
        doc["copy_threshold_s"] = 1.5
        rc, out, _ = run_main([self.files.write("d.json", doc), self.torch])
        self.assertEqual(rc, 0)
        self.assertIn("### Copy-engine lanes, GB/s per direction", out)
        self.assertIn("| 256 MiB | – | 383.0 [381.0–385.0] | 374.0 [372.0–376.0] | – | 352.0 [350.0–354.0] |", out)
        self.assertIn("which took 1.50 s", out)
        self.assertIn("| 1 MiB | 10.0 | 12.0 | 10.0 | 12.0 | nccl |", out)
        self.assertIn("| 4 MiB | 30.0 | 25.0 | 30.0 | 25.0 | copy |", out)
        self.assertIn("Chosen: `copy_from` 4MiB.", out)
        doc["copy_threshold"]["copy_from"] = None
        _, out, _ = run_main([self.files.write("d2.json", doc), self.torch])
        self.assertIn("Chosen: `copy_from` off", out)
        # Without the measurement, no such section.
        _, out, _ = run_main([self.duplex, self.torch])
        self.assertNotIn("measured (`Local::measure_copy_from`", out)

    def test_write_baseline_then_compare_with_itself(self):
        base = self.files.path("baseline.json")
        rc, _, _ = run_main([self.duplex, self.torch, "--write-baseline", base, "--baseline-note", "fixture"])
        self.assertEqual(rc, 0)
        doc = bt.load_json(base)
        self.assertEqual(doc["format"], bt.BASELINE_FORMAT)
        self.assertEqual(doc["about"], "fixture")
        self.assertEqual(doc["figures"]["torch:two_pgs/256MiB"]["trials"], [340, 341, 342, 343, 344])
        rc, out, _ = run_main([self.duplex, self.torch, "--baseline", base, "--strict"])
        self.assertEqual(rc, 0)
        self.assertIn(f"{len(doc['figures'])} within band.", out)
        self.assertNotIn("†", out.split("### Compared")[0].split("\n", 3)[3])

    def test_strict_fails_on_a_figure_worse_beyond_the_spread(self):
        base = self.files.path("baseline.json")
        run_main([self.duplex, self.torch, "--write-baseline", base])
        worse = dict(GOOD_DUPLEX)
        # Base 350–354, median 352: the band starts 17.6 below 350.
        worse["both_ways/256MiB"] = [320, 321, 322, 323, 324]
        path = self.files.write("worse.json", new_duplex(worse))
        rc, out, err = run_main([path, self.torch, "--baseline", base])
        self.assertEqual(rc, 0)  # not strict: a report only
        self.assertIn("322.0 [320.0–324.0] †", out)
        self.assertIn("**changed beyond band (worse)**", out)
        rc, out, err = run_main([path, self.torch, "--baseline", base, "--strict"])
        self.assertEqual(rc, 1)
        self.assertIn("duplex:both_ways/256MiB", err)

    def test_the_default_slack_passes_a_small_shift_and_a_deterministic_figure(self):
        # Every trial a little worse than the baseline's worst: within 5% of
        # the median past it, this passes by default; so does a figure whose
        # trials are all equal (lane_bytes: a band of width zero without
        # slack) that moved by 1%.
        base = self.files.path("baseline.json")
        run_main([self.duplex, self.torch, "--write-baseline", base])
        moved = dict(GOOD_DUPLEX)
        moved["both_ways/256MiB"] = [336, 337, 338, 339, 340]  # base 350-354: -4% of 352
        moved["lane_bytes/lane:0->1"] = [207618048 * 1.01] * 5
        path = self.files.write("moved.json", new_duplex(moved))
        rc, out, err = run_main([path, self.torch, "--baseline", base, "--strict"])
        self.assertEqual(rc, 0, err)
        self.assertIn("| duplex:both_ways/256MiB (GB/s, higher is better) | 352.0 [350.0–354.0] (5) "
                      "| 338.0 [336.0–340.0] | -4.0% | 332.4–371.6 ([min, max] ±5% of the median) | within band |", out)
        rc, _, err = run_main([path, self.torch, "--baseline", base, "--strict", "--slack", "0"])
        self.assertEqual(rc, 1)
        self.assertIn("regressed (every trial worse than the baseline's band): duplex:both_ways/256MiB, "
                      "duplex:lane_bytes/lane:0->1", err)

    def test_strict_passes_when_only_better(self):
        base = self.files.path("baseline.json")
        run_main([self.duplex, self.torch, "--write-baseline", base])
        better = dict(GOOD_DUPLEX)
        better["host_us"] = [5.0] * 5
        path = self.files.write("better.json", new_duplex(better))
        rc, out, _ = run_main([path, self.torch, "--baseline", base, "--strict"])
        self.assertEqual(rc, 0)
        self.assertIn("5.00 [5.00–5.00] †", out)
        self.assertIn("changed beyond band (better)", out)

    def test_old_format_files_as_baseline(self):
        old_d = self.files.write("old-duplex.json", OLD_DUPLEX)
        old_t = self.files.write("old-torch.json", OLD_TORCH)
        rc, out, err = run_main([self.duplex, self.torch, "--baseline", old_d, "--baseline", old_t])
        # GOOD_DUPLEX's latency (7.2 us) and host time are far better than
        # the old ones, and nothing got worse by more than 10% ...
        self.assertEqual(rc, 0, err)
        self.assertIn("one trial ±10%", out)
        self.assertIn("**new (no baseline)**", out)  # the raw bandwidth figures
        self.assertNotIn("changed beyond band (worse)", out)
        # ... but under --strict the figures the old format lacks were never
        # judged, and that fails.
        rc, _, err = run_main([self.duplex, self.torch, "--baseline", old_d, "--baseline", old_t, "--strict"])
        self.assertEqual(rc, 1)
        self.assertIn("have no baseline, so they were not judged: ", err)
        self.assertIn("duplex:raw_one_way/256MiB", err)
        # ... but with a 5% tolerance the 64 MiB both ways figure (327 vs
        # 309.1, +5.8%) is "better" and torch's 1 MiB PGs (16 vs 14.3) too.
        rc, out, _ = run_main([self.duplex, self.torch, "--baseline", old_d, "--baseline", old_t,
                               "--tolerance", "0.05"])
        self.assertIn("| duplex:both_ways/64MiB (GB/s, higher is better) | 309.1 (1) | 327.0 [325.0–329.0] | +5.8%", out)

    def test_old_format_files_as_current_run(self):
        old_d = self.files.write("old-duplex.json", OLD_DUPLEX)
        old_t = self.files.write("old-torch.json", OLD_TORCH)
        rc, out, _ = run_main([old_d, old_t])
        self.assertEqual(rc, 0)
        self.assertIn("| 256 MiB | 357.4 | – | 356.6 | 352.0 | – | 301.0 | 342.0 | 0.985× | 1.029× |", out)

    def test_strict_fails_on_a_figure_without_baseline_and_says_how_to_rewrite_it(self):
        base = self.files.path("baseline.json")
        fewer = {k: v for k, v in GOOD_DUPLEX.items() if k != "lane_latency_us"}
        run_main([self.files.write("fewer.json", new_duplex(fewer)), self.torch, "--write-baseline", base])
        # Not strict: reported only.
        rc, out, _ = run_main([self.duplex, self.torch, "--baseline", base])
        self.assertEqual(rc, 0)
        self.assertIn("| duplex:lane_latency_us (µs, lower is better) | – | 7.20 [7.00–7.40] | – | – "
                      "| **new (no baseline)** |", out)
        rc, _, err = run_main([self.duplex, self.torch, "--baseline", base, "--strict"])
        self.assertEqual(rc, 1)
        self.assertEqual(err.strip().splitlines(), [
            "bench_table: strict: 1 figure(s) have no baseline, so they were not judged: duplex:lane_latency_us; "
            "once this run is checked (5 trials or more, on the GPUs), make it the baseline: "
            f"python3 scripts/bench_table.py {self.duplex} {self.torch} --write-baseline {base} "
            '--baseline-note "..."'])

    def test_the_committed_baseline_lacks_figures_a_run_now_takes(self):
        # docs/gpu/bench-baseline.json is GPU run 5 (one trial per figure):
        # it has no raw-NCCL, copy-engine or policy-latency figures, so a
        # strict comparison with it fails until it is replaced
        # (BENCHMARKS.md, "Baseline comparison").
        rc, _, err = run_main([self.duplex, self.torch, "--baseline",
                               os.path.join(REPO, "docs/gpu/bench-baseline.json"), "--strict"])
        self.assertEqual(rc, 1)
        for name in ("duplex:raw_one_way/256MiB", "duplex:copy_both_ways/256MiB", "duplex:ce_one_way/256MiB",
                     "duplex:lane_latency_us", "duplex:copy_latency_us"):
            self.assertIn(name, err)
        self.assertIn(f"--write-baseline {os.path.join(REPO, 'docs/gpu/bench-baseline.json')}", err)

    def test_strict_fails_a_figure_of_fewer_than_min_trials(self):
        base = self.files.path("baseline.json")
        run_main([self.duplex, self.torch, "--write-baseline", base])
        three = {k: v[:3] for k, v in GOOD_DUPLEX.items()}
        path = self.files.write("three.json", new_duplex(three))
        rc, _, err = run_main([path, self.torch, "--baseline", base])
        self.assertEqual(rc, 0)  # not strict: a report only
        rc, _, err = run_main([path, self.torch, "--baseline", base, "--strict"])
        self.assertEqual(rc, 1)
        self.assertIn(f"bench_table: strict: {len(three)} figure(s) of this run have fewer than 5 trials, "
                      "too few to judge: duplex:both_ways/1MiB, ", err)
        self.assertNotIn("torch:", err)
        rc, _, err = run_main([path, self.torch, "--baseline", base, "--strict", "--min-trials", "3"])
        self.assertEqual(rc, 0, err)

    def test_a_baseline_of_one_trial_is_judged_but_said_to_need_replacing(self):
        one = {k: v[:1] for k, v in GOOD_DUPLEX.items()}
        base = self.files.path("baseline.json")
        run_main([self.files.write("one.json", new_duplex(one)), self.files.write("t1.json", new_torch(
            {k: v[:1] for k, v in GOOD_TORCH.items()})), "--write-baseline", base])
        rc, out, err = run_main([self.duplex, self.torch, "--baseline", base, "--strict"])
        # Judged within ±10% of the one trial: nothing regressed ...
        self.assertEqual(rc, 0, err)
        self.assertIn("(one trial ±10%)", out)
        # ... but the report and stderr say the baseline should be replaced.
        n = len(GOOD_DUPLEX) + len(GOOD_TORCH)
        said = (f"the baseline has {n} figure(s) of fewer than 5 trials (a figure of one trial is judged within "
                "±tolerance of its value): replace it with a run of 5 trials or more on the GPUs: "
                f"python3 scripts/bench_table.py {self.duplex} {self.torch} --write-baseline {base}")
        self.assertIn(f"### Compared with the baseline ({base})\n\nNote: {said}", out)
        self.assertIn(f"bench_table: warning: {said}", err)
        # A baseline of five trials says nothing of the kind.
        run_main([self.duplex, self.torch, "--write-baseline", base])
        rc, out, err = run_main([self.duplex, self.torch, "--baseline", base, "--strict"])
        self.assertEqual((rc, err), (0, ""))
        self.assertNotIn("fewer than 5 trials", out)

    def test_a_missing_input_is_a_note_and_fails_strict(self):
        base = self.files.path("baseline.json")
        run_main([self.duplex, self.torch, "--write-baseline", base])
        rc, out, err = run_main([self.duplex, self.files.path("absent.json"), "--baseline", base])
        self.assertEqual(rc, 0)
        self.assertIn("Note: ", out)
        self.assertIn("**not measured**", out)
        rc, _, err = run_main([self.duplex, self.files.path("absent.json"), "--baseline", base, "--strict"])
        self.assertEqual(rc, 1)
        self.assertIn("torch:latency_us", err)

    def test_a_figure_with_a_null_or_nan_trial_is_a_note_and_not_measured(self):
        base = self.files.path("baseline.json")
        run_main([self.duplex, self.torch, "--write-baseline", base])
        doc = new_duplex(GOOD_DUPLEX)
        doc["figures"]["latency_us"]["trials"][1] = None   # serde_json's NaN
        doc["figures"]["host_us"]["trials"][0] = float("nan")
        path = self.files.write("null.json", doc)
        rc, out, err = run_main([path, self.torch, "--baseline", base])
        self.assertEqual(rc, 0, err)
        self.assertIn(f"Note: {path}: figure latency_us not read (trial 2 of 5 is null, not a finite number); "
                      "it is not measured", out)
        self.assertIn(f"Note: {path}: figure host_us not read (trial 1 of 5 is NaN", out)
        rc, out, err = run_main([path, self.torch, "--baseline", base, "--strict"])
        self.assertEqual(rc, 1)
        self.assertIn("bench_table: strict: 2 baseline figure(s) not measured in this run: duplex:host_us, "
                      "duplex:latency_us", err)

    def test_a_baseline_figure_without_median_or_trials_is_an_unreadable_baseline(self):
        base = self.files.path("baseline.json")
        run_main([self.duplex, self.torch, "--write-baseline", base])
        doc = bt.load_json(base)
        doc["figures"]["duplex:latency_us"] = {"unit": "us", "better": "lower"}
        self.files.write("baseline.json", doc)
        rc, _, err = run_main([self.duplex, self.torch, "--baseline", base, "--strict"])
        self.assertEqual(rc, 2)
        self.assertIn(f"bench_table: the baseline {base} could not be read (figure duplex:latency_us: it has "
                      "neither trials nor a median): no figure was compared with a baseline", err)
        doc["figures"]["duplex:latency_us"] = {"unit": "us", "better": "lower", "trials": [7.0, None]}
        self.files.write("baseline.json", doc)
        rc, _, err = run_main([self.duplex, self.torch, "--baseline", base, "--strict"])
        self.assertEqual(rc, 2)
        self.assertIn("(figure duplex:latency_us: trial 2 of 2 is null, not a finite number)", err)

    def test_a_null_in_the_measured_threshold_is_shown_not_a_crash(self):
        doc = new_duplex(GOOD_DUPLEX)
        doc["copy_threshold"] = {"trials": 5, "copy_from": None, "sizes": [
            {"bytes": MiB, "nccl_one_way": None, "copy_one_way": 12.0, "nccl_both_ways": 10.0, "copy_both_ways": 12.0}]}
        rc, out, _ = run_main([self.files.write("d.json", doc), self.torch])
        self.assertEqual(rc, 0)
        self.assertIn("| 1 MiB | – | 12.0 | 10.0 | 12.0 | – |", out)

    def test_a_latency_without_better_is_worse_when_higher(self):
        # bench.rs always says; a figure that does not is judged by its unit,
        # not as "higher is better" (which called a slower latency better).
        base = self.files.path("baseline.json")
        run_main([self.duplex, self.torch, "--write-baseline", base])
        doc = new_duplex(dict(GOOD_DUPLEX, latency_us=[9.0, 9.1, 9.2, 9.3, 9.4]))
        for f in doc["figures"].values():
            del f["better"]
        path = self.files.write("nobetter.json", doc)
        b = bt.load_json(base)
        for f in b["figures"].values():
            del f["better"]
        self.files.write("baseline.json", b)
        rc, out, err = run_main([path, self.torch, "--baseline", base, "--strict"])
        self.assertEqual(rc, 1)
        self.assertIn("regressed (every trial worse than the baseline's band): duplex:latency_us", err)
        self.assertIn("| duplex:latency_us (µs, lower is better) |", out)

    def test_a_unit_that_changed_fails_strict(self):
        base = self.files.path("baseline.json")
        run_main([self.duplex, self.torch, "--write-baseline", base])
        doc = new_duplex(GOOD_DUPLEX)
        doc["figures"]["lane_create_ms/lane:0->1"]["unit"] = "us"
        path = self.files.write("units.json", doc)
        rc, out, _ = run_main([path, self.torch, "--baseline", base])
        self.assertEqual(rc, 0)
        self.assertIn("| **unit changed** (ms → us) |", out)
        rc, _, err = run_main([path, self.torch, "--baseline", base, "--strict"])
        self.assertEqual(rc, 1)
        self.assertIn("bench_table: strict: 1 figure(s) changed unit, so they cannot be compared: "
                      "duplex:lane_create_ms/lane:0->1 (baseline ms, now us)", err)

    def test_an_unreadable_baseline_is_a_usage_error(self):
        rc, out, err = run_main([self.duplex, self.torch, "--baseline", self.files.path("absent.json")])
        self.assertEqual(rc, 2)
        self.assertIn("absent.json could not be read", err)
        # The tables are still written, and say that nothing was compared.
        self.assertIn("### Bandwidth", out)
        self.assertIn("no figure was compared with a baseline", out)
        self.assertNotIn("### Compared with the baseline", out)

    def test_strict_without_a_baseline_is_a_usage_error(self):
        # A strict run that compared nothing must not pass.
        with contextlib.redirect_stderr(io.StringIO()) as err, self.assertRaises(SystemExit) as e:
            bt.main([self.duplex, self.torch, "--strict"])
        self.assertEqual(e.exception.code, 2)
        self.assertIn("--strict needs --baseline", err.getvalue())

    def test_cta_sweep_table(self):
        sweep = new_duplex({"one_way/256MiB": [360, 361, 362, 363, 364],
                            "both_ways/256MiB": [355, 356, 357, 358, 359]})
        sweep["ctas"] = [64, 64]
        path = self.files.write("ctas-64.json", sweep)
        rc, out, _ = run_main([self.duplex, self.torch, "--ctas", path])
        self.assertEqual(rc, 0)
        self.assertIn("| NCCL's default | as the main run | 198.0 [198.0–198.0] | 32.0 [30.0–34.0] "
                      "| 357.0 [355.0–359.0] | 352.0 [350.0–354.0] | 0.986× | 1.029× |", out)
        self.assertIn("| 64 | as the main run | – | – | 362.0 [360.0–364.0] | 357.0 [355.0–359.0] | 0.986× | 1.044× |", out)

    def test_settings_only_compares_each_setting_with_the_first(self):
        ref = new_duplex({"one_way/256MiB": [360] * 3, "both_ways/256MiB": [350] * 3,
                          "lane_bytes/lane:0->1": [200 * MiB], "lane_create_ms/lane:0->1": [30]})
        ref["env"] = {"NCCL_NVLS_ENABLE": "0"}
        small = new_duplex({"one_way/256MiB": [355] * 3, "both_ways/256MiB": [315] * 3,
                            "lane_bytes/lane:0->1": [50 * MiB], "lane_create_ms/lane:0->1": [20]})
        small["env"] = {"NCCL_NVLS_ENABLE": "0", "NCCL_BUFFSIZE": "1048576"}
        rc, out, _ = run_main(["--settings-only", self.files.write("ref.json", ref),
                               self.files.write("small.json", small), self.files.path("absent.json")])
        self.assertEqual(rc, 0)
        self.assertIn("| NCCL's default | as the first row | 200.0 | 30.0 | 360.0 [360.0–360.0] "
                      "| 350.0 [350.0–350.0] | 0.972× | 1.000× | 1.000× |", out)
        self.assertIn("| NCCL's default | NCCL_BUFFSIZE=1048576 | 50.0 | 20.0 | 355.0 [355.0–355.0] "
                      "| 315.0 [315.0–315.0] | 0.887× | 0.250× | 0.900× |", out)
        self.assertIn("absent.json: not read", out)
        # Nothing readable is an error; no file at all a usage error.
        rc, out, _ = run_main(["--settings-only", self.files.path("absent.json")])
        self.assertEqual(rc, 1)
        self.assertIn("No run was read.", out)
        self.assertEqual(run_main(["--settings-only"])[0], 2)

    def test_lane_settings_name_their_nccl_environment(self):
        main = new_duplex(GOOD_DUPLEX)
        main["env"] = {"NCCL_NVLS_ENABLE": "0"}
        small = new_duplex({"one_way/256MiB": [350] * 5, "both_ways/256MiB": [340] * 5,
                            "lane_bytes/lane:0->1": [50 * MiB] * 1, "lane_create_ms/lane:0->1": [20]})
        small["env"] = {"NCCL_NVLS_ENABLE": "0", "NCCL_BUFFSIZE": "1048576"}
        rc, out, _ = run_main([self.files.write("main.json", main), self.torch,
                               "--setting", self.files.write("small.json", small)])
        self.assertEqual(rc, 0)
        self.assertIn("| NCCL's default | NCCL_BUFFSIZE=1048576 | 50.0 | 20.0 | 350.0 [350.0–350.0] "
                      "| 340.0 [340.0–340.0] | 0.971× | 0.994× |", out)
        self.assertEqual(bt.env_label({}, {"NCCL_PROTO": "Simple"}), "NCCL_PROTO unset")


if __name__ == "__main__":
    unittest.main()
