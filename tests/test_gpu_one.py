"""benchmarks/gpu_one.py, the check for a single lent GPU: a section that fails is recorded and the next one runs, a
failed run's errors are found in what it printed, and its lesson runner executes a lesson as nbdev_test would."""
import importlib.util
import json
import subprocess

import pytest

from conftest import PY, ROOT

_spec = importlib.util.spec_from_file_location("gpu_one", ROOT / "benchmarks" / "gpu_one.py")
g1 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(g1)


@pytest.mark.fast
def test_errors_are_found_before_the_launchers_report():
    printed = ("step 1\nTraceback (most recent call last):\n  File x\nValueError: the real cause\n"
               "distcourse.train: error: a refusal\n" + "=" * 700 + "\nChildFailedError:\n")
    found = g1.why(printed)
    assert "ValueError: the real cause" in found and "distcourse.train: error: a refusal" in found
    assert "step 1" not in found.split("...")[0]


def test_sections_that_fail_are_recorded_and_the_next_runs(tmp_path):
    "Without a GPU, facts and nccl fail; the forks probe runs; all three land in the JSON."
    out = tmp_path / "r.json"
    proc = subprocess.run([PY, "benchmarks/gpu_one.py", "--only", "facts,nccl,forks", "--out", str(tmp_path / "o"),
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert "error" in res["facts"] and "error" in res["nccl"]
    assert res["forks"]["fresh process"] == "0" and res["forks"]["after a CPU backward"] == "0"  # no GPU: no threads


@pytest.mark.fast
def test_the_lesson_runner_fails_on_a_failing_cell(tmp_path):
    nb = {"cells": [{"cell_type": "code", "source": ["x = 1\n"]}, {"cell_type": "markdown", "source": ["# t"]},
                    {"cell_type": "code", "source": ["#| slow\n", "raise ValueError('skipped: slow')\n"]},
                    {"cell_type": "code", "source": ["assert x == 2, 'planted'\n"]}]}
    (path := tmp_path / "t.ipynb").write_text(json.dumps(nb))
    proc = subprocess.run([PY, "benchmarks/gpu_one.py", "--lesson", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "planted" in proc.stderr and "skipped: slow" not in proc.stderr
