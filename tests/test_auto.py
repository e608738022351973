"""`auto` measured (lesson 04b): one measurement per machine and shape, shared by the processes of a launch under a
file lock, recorded in run.json, kept out of the run's random numbers; a bad cache file set aside, not lost."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import ACCELERATE, PY, free_port, run_cli
from distcourse import auto
from distcourse.auto import cached, faster_precision

QUICK = ["--model", "tiny", "--seq_len", "32", "--batch_size", "4", "--max_steps", "3", "--eval_every", "0",
         "--log_every", "1", "--max_examples", "300", "--tracker", "none"]
TINY = SimpleNamespace(model="tiny", n_layer=0, task="clm", tokenizer="stdlib", batch_size=2, seq_len=16,
                       zero_stage=0, mesh="", activation_checkpointing="")


def test_processes_measure_once(tmp_path):
    "Three processes ask at once: the first to take the lock measures, the others wait and read its answer."
    code = ("import json, os, sys, time\nfrom distcourse.auto import cached\n"
            "def measure():\n    open(sys.argv[2], 'a').write(f'{os.getpid()}\\n'); time.sleep(1.0)\n"
            "    return {'fp32': 1.0, 'bf16': 0.5}\n"
            "print(json.dumps(cached({'what': 'test'}, measure, sys.argv[1])))")
    procs = [subprocess.Popen([PY, "-c", code, str(tmp_path / "auto.json"), str(tmp_path / "marks")],
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    answers = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert len((tmp_path / "marks").read_text().split()) == 1
    assert sorted(a["cached"] for a in answers) == [False, True, True]
    assert len({(a["fp32"], a["bf16"], a["date"]) for a in answers}) == 1


@pytest.mark.fast
def test_bad_cache_is_set_aside(tmp_path, capsys):
    path = tmp_path / "auto.json"
    path.write_text("[1, 2]")  # JSON, but not a cache
    got = cached({"what": "x"}, lambda: {"s": 1.0}, path)
    assert not got["cached"] and (tmp_path / "auto.json.bad").read_text() == "[1, 2]"
    assert "moved to" in capsys.readouterr().err
    assert cached({"what": "x"}, lambda: {"s": 2.0}, path)["s"] == 1.0  # kept: measured once


@pytest.mark.fast
def test_measuring_leaves_the_random_numbers(tmp_path, monkeypatch):
    "A run that measured draws what one that read the cache draws: the throwaway model's init is forked off."
    monkeypatch.setenv("DISTCOURSE_CACHE", str(tmp_path / "auto.json"))
    monkeypatch.setattr(auto, "_TAKEN", {})
    torch.manual_seed(0)
    state = torch.get_rng_state()
    rates = auto._rates(TINY)
    assert not rates["cached"] and torch.equal(torch.get_rng_state(), state)
    assert auto.measured(TINY) == {"precision": rates}


@pytest.mark.fast
def test_auto_precision_flips_with_the_numbers(monkeypatch):
    "The choice follows the measurement, whichever way it goes (the rates stubbed: a fast bf16, a slow one)."
    for bf16, want in ((0.5, "bf16"), (2.0, "no"), (0.99, "no")):
        monkeypatch.setattr(auto, "_rates", lambda cfg, compiled=None, b=bf16: {"fp32": 1.0, "bf16": b})
        assert auto.auto_precision(TINY)[0] == want


def test_trainer_measures_then_reads(tmp_path):
    "The first run of a shape measures (run.json says so), the second reads the cache and chooses the same."
    env = {"DISTCOURSE_CACHE": str(tmp_path / "auto.json")}
    seen = []
    for name in ("first", "second"):
        proc = run_cli([PY, "-m", "distcourse.train", *QUICK, "--output_dir", str(tmp_path / name)], env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen.append(json.loads((tmp_path / name / "run.json").read_text())["choices"])
    (a, b) = [c["measured"]["precision"] for c in seen]
    assert (a["cached"], b["cached"]) == (False, True) and (a["fp32"], a["bf16"]) == (b["fp32"], b["bf16"])
    assert seen[0]["mixed_precision"] == seen[1]["mixed_precision"]
    assert seen[0]["mixed_precision"]["value"] == faster_precision(a)[0]


def test_launch_shares_one_measurement(tmp_path):
    """Two processes of one launch: the cache holds one precision measurement, taken at the threads each process
    computes with (that only the first process to take the lock measures is test_processes_measure_once's)."""
    env = {"DISTCOURSE_CACHE": str(tmp_path / "auto.json")}
    proc = run_cli([*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()),
                    "-m", "distcourse.train", *QUICK, "--output_dir", str(tmp_path / "two")], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    keys = [json.loads(k) for k in json.loads((tmp_path / "auto.json").read_text())]
    res = json.loads((tmp_path / "two" / "run.json").read_text())
    assert [k["what"] for k in keys] == ["precision"]
    assert keys[0]["threads"] == res["threads_per_process"]


@pytest.mark.fast
def test_compiled_loss_compiles_after_a_dispatch_mode():
    """Dynamo skips for good a function first called under a dispatch mode (the trainer's first step runs in 05's
    PeakMemory): torch.compile's loss would never compile; compiled_loss runs eager there and compiles after."""
    from torch._dynamo.utils import counters
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None): return func(*args, **(kwargs or {}))

    def f(x): return (x.sin() + 1).sum()
    graphs = {}
    for name, make in (("torch.compile", torch.compile), ("compiled_loss", auto.compiled_loss)):
        torch._dynamo.reset(); counters.clear()
        fn = make(f)
        with Watch(): fn(torch.ones(3))
        fn(torch.ones(3))
        graphs[name] = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs == {"torch.compile": 0, "compiled_loss": 1}


def test_trainer_compiles_when_it_says_so(tmp_path):
    "--compile true: dynamo compiled the loss in the trainer (its first step under PeakMemory notwithstanding)."
    code = ("import sys\nfrom torch._dynamo.utils import counters\nfrom distcourse.train import main\n"
            "main(sys.argv[1:])\nprint('GRAPHS', counters['stats']['unique_graphs'])")
    proc = run_cli([PY, "-c", code, *QUICK, "--compile", "true", "--mixed_precision", "no",
                    "--output_dir", str(tmp_path / "c")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    graphs = int(next(l for l in proc.stdout.splitlines() if l.startswith("GRAPHS")).split()[1])
    assert graphs >= 1, proc.stdout[-2000:]


@pytest.mark.fast
def test_a_failed_measurement_is_said_not_fatal(monkeypatch):
    "A model that cannot be measured keeps 04a's rule for precision; a compile that fails keeps the run eager."
    def broken(cfg, compiled=None):
        if compiled: raise RuntimeError("no C++ compiler")
        raise ValueError("cannot build it")
    monkeypatch.setattr(auto, "_rates", broken)
    precision, why = auto.auto_precision(TINY)
    assert "the measurement failed: ValueError: cannot build it" in why
    monkeypatch.setattr(auto, "_rates", lambda cfg, compiled=None: broken(cfg, compiled) if compiled else
                        {"fp32": 1.0, "bf16": 0.5})
    got = auto.compile_choice(TINY, 10**4, "bf16", "cpu")
    assert got["value"] is False and "the measurement failed (RuntimeError: no C++ compiler)" in got["why"]
    monkeypatch.setattr(auto, "_rates", broken)  # --mixed_precision given, the eager step cannot be measured
    got = auto.compile_choice(TINY, 10**4, "no", "cpu")
    assert got["value"] is False and "the measurement failed (ValueError: cannot build it)" in got["why"]
