import json, os, shutil, subprocess, sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# Tests never reach the Hub: everything they use is built offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


from distcourse.launch import free_port  # noqa: E402  (below the ephemeral ports gloo's connections take)


def run_cli(args, cwd=ROOT, timeout=600, env=None):
    "Run a command line, returning the CompletedProcess (text mode)."
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def run_worker(module, worker, out_dir, num_processes=2, timeout=300, **kw):
    "`distcourse.<module>.<worker>(out_dir, **kw)` on `num_processes` processes in a fresh interpreter; a hang fails."
    code = ("import json, sys; from functools import partial; from distcourse.launch import launch; "
            f"from distcourse.{module} import {worker} as w; "
            f"launch(partial(w, **json.loads(sys.argv[2])), (sys.argv[1],), num_processes={num_processes})")
    proc = run_cli([PY, "-c", code, str(out_dir), json.dumps(kw)], timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture
def cli():
    return run_cli


PY = sys.executable
ACCELERATE = [PY, "-m", "accelerate.commands.launch"]


def trainer_cmd(world, timeout=240) -> list:
    """`python -m distcourse.train` on `world` processes forked from one interpreter (lesson 02a's `launch`, which
    stops them after `timeout` s): the gloo group and trainer that `accelerate launch --multi_gpu` gives, with torch
    imported once rather than once per rank, the flags parsed in each rank. Append the trainer's flags."""
    if world == 1: return [PY, "-m", "distcourse.train"]
    return [PY, "-c", "import sys; from distcourse.launch import launch; from distcourse.train import main; "
            f"launch(main, (sys.argv[2:],), num_processes=int(sys.argv[1]), timeout={timeout})", str(world)]


def fresh_copy(dest):
    "The repository's tracked files, as they are in the working tree, copied into `dest`: what a clone holds."
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    for name in filter(None, files.stdout.split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def copy_env(repo):
    "Environment in which `repo` (a fresh copy) is the `distcourse` that Python imports, with the data cache shared."
    return {**os.environ, "PYTHONPATH": str(repo),  # as `pip install -e .` in the copy would give
            "DISTCOURSE_DATA": str(ROOT / "data")}  # the offline corpus cache (content-keyed): no rebuild


def worst_rel(want, got) -> float:
    "The largest relative difference of two equally long per-step lists (losses, gradient norms)."
    assert len(want) == len(got) > 0, (len(want), len(got))
    return max(abs(a - b) / abs(a) for a, b in zip(want, got))


def grads_diff(want, got) -> float:  # {name: full gradient} dicts, or paths of files holding them
    "The largest ‖Δg‖ of one parameter over the whole gradient's norm; names and shapes must match."
    want, got = (torch.load(g) if isinstance(g, (str, Path)) else g for g in (want, got))
    assert want.keys() == got.keys(), sorted(set(want) ^ set(got))
    shapes = [k for k in want if want[k].shape != got[k].shape]
    assert not shapes, shapes
    # Over the whole norm, not each parameter's own: the key third of c_attn.bias has a zero
    # gradient in exact arithmetic (softmax ignores a shift of all scores): its own ratio is noise.
    whole = sum(g.double().pow(2).sum() for g in want.values()).sqrt()
    return max(((got[k].double() - g.double()).norm() / whole).item() for k, g in want.items())
