"""The trainer's fast defaults, each with its reason in run.json: threads per process (every core, unless the user
chose), --mixed_precision auto and --compile auto (measured on this machine, lesson 04b)."""
import json
import os

import pytest

from conftest import ACCELERATE, PY, free_port, run_cli
from distcourse.auto import COMPILE_WORTH_S, faster_precision

QUICK = ["--model", "tiny", "--seq_len", "32", "--batch_size", "4", "--max_steps", "3", "--eval_every", "0",
         "--log_every", "1", "--max_examples", "300", "--tracker", "none"]
NO_OMP = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
CORES = len(os.sched_getaffinity(0))  # the cores this machine lets a process run on (Linux, as CI)


def run(cmd, out, env=None):
    proc = run_cli([*cmd, "-m", "distcourse.train", *QUICK, "--output_dir", str(out)], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "run.json").read_text()), proc.stdout


def without_omp(tmp_path, cmd, **extra):
    "Run with no OMP_NUM_THREADS in the environment (the run_cli env adds to os.environ, so start from a copy)."
    saved = os.environ.pop("OMP_NUM_THREADS", None)
    try: return run(cmd, tmp_path, extra or None)
    finally:
        if saved is not None: os.environ["OMP_NUM_THREADS"] = saved


def test_auto_defaults_under_accelerate_launch(tmp_path):
    "accelerate launch sets OMP_NUM_THREADS=1 by itself; the run still uses every core, and says why."
    res, stdout = without_omp(tmp_path, [*ACCELERATE, "--num_processes", "1"])
    c = res["choices"]
    assert res["threads_per_process"] == CORES and c["threads"]["why"].startswith(f"{CORES} cores / 1")
    rates = c["measured"]["precision"]  # auto measured fp32 and bf16 here: those numbers decide, and are recorded
    assert rates["fp32"] > 0 and rates["bf16"] > 0
    assert (c["mixed_precision"]["value"], c["mixed_precision"]["why"]) == faster_precision(rates)
    assert res["mixed_precision"] == c["mixed_precision"]["value"]
    eager = rates["bf16" if res["mixed_precision"] == "bf16" else "fp32"]  # 3 steps of it: far under a minute
    assert c["compile"] == {"value": False, "why": f"auto: 3 steps x {eager * 1e3:.0f} ms = {3 * eager:.0f} s eager, "
                                                   f"under the {COMPILE_WORTH_S} s for which compile is measured"}
    assert "chose: mixed precision" in stdout.splitlines()[-1]  # the last line says what was chosen


def test_user_threads_are_kept(tmp_path):
    "OMP_NUM_THREADS in the launcher's environment is the user's choice: kept, and named as such."
    res, _ = without_omp(tmp_path, [*ACCELERATE, "--num_processes", "1"], OMP_NUM_THREADS="1")
    assert res["threads_per_process"] == 1 and "the user's choice" in res["choices"]["threads"]["why"]


def test_two_processes_share_the_cores(tmp_path):
    res, _ = without_omp(tmp_path, [*ACCELERATE, "--multi_gpu", "--num_processes", "2",
                                     "--main_process_port", str(free_port())])
    assert res["world_size"] == 2 and res["threads_per_process"] == max(1, CORES // 2)


def test_compile_true_trains(tmp_path):
    "--compile true compiles the loss (model and cross-entropy) and trains; fp32 pinned."
    out = tmp_path / "compiled"
    proc = run_cli([PY, "-m", "distcourse.train", *QUICK, "--compile", "true", "--mixed_precision", "no",
                    "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "run.json").read_text())
    assert res["choices"]["compile"] == {"value": True, "why": "asked for"} and res["mixed_precision"] == "no"
    assert res["final"]["loss"] < res["before"]["loss"]


@pytest.mark.parametrize("flag,value", [("--compile", "yes"), ("--mixed_precision", "fp8")])
def test_bad_choice(tmp_path, flag, value):
    proc = run_cli([PY, "-m", "distcourse.train", *QUICK, flag, value, "--output_dir", str(tmp_path / "x")])
    assert proc.returncode == 2 and f"{flag} {value!r}: choose one of" in proc.stderr
