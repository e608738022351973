import json, os, shutil, subprocess, sys, tempfile
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# Tests never reach the Hub: everything they use is built offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# `auto`'s measurements (lesson 04b) go to a cache of this session's own, not the user's
os.environ.setdefault("DISTCOURSE_CACHE", str(Path(tempfile.mkdtemp(prefix="distcourse-auto-")) / "auto.json"))


from distcourse.launch import free_port  # noqa: E402  (below the ephemeral ports gloo's connections take)


def site_build():
    "site/build.py as a module (the lessons' freshness check, the site's pages)."
    import importlib.util
    spec = importlib.util.spec_from_file_location("site_build", ROOT / "site/build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def grads_diff(want, got, floor=1e-6) -> float:  # {name: full gradient} dicts, or paths of files holding them
    """The largest ‖Δg‖ / ‖g‖ over the parameters, each tensor against its own norm; names, shapes must match.

    Against its own norm, not the whole gradient's: a wrong LayerNorm gain or bias is a small tensor, and its error
    passes under 1e-5 of the whole norm. A tensor whose true gradient is (near) zero (an expert no token reached,
    position rows past seq_len are inside larger tensors and do not count) is measured against `floor` × the whole
    norm instead, so rounding noise on a zero is not divided by zero."""
    return worst_tensor(want, got, floor)[0]


def worst_tensor(want, got, floor=1e-6) -> tuple:
    "(largest per-tensor relative error, the parameter's name): `grads_diff` with the tensor that gave it."
    want, got = (torch.load(g) if isinstance(g, (str, Path)) else g for g in (want, got))
    assert want.keys() == got.keys(), sorted(set(want) ^ set(got))
    shapes = [k for k in want if want[k].shape != got[k].shape]
    assert not shapes, shapes
    whole = sum(g.double().pow(2).sum() for g in want.values()).sqrt()
    rel = {k: ((got[k].double() - g.double()).norm() / torch.maximum(g.double().norm(), floor * whole)).item()
           for k, g in want.items()}
    name = max(rel, key=rel.get)
    return rel[name], name


def print_table(request, lines):
    "Print `lines` after a module's tests, past pytest's output capture (shown even under -q); nothing if empty."
    if not lines: return
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else nullcontext():
        print("\n\n" + "\n".join(lines))


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="run the full tier too (CI sets it by setting CI)")


def full_tier(config) -> bool:
    "The full tier runs under CI (any CI but '', '0' or 'false') or with --full; else the fast tier alone."
    return config.getoption("--full") or os.getenv("CI", "").lower() not in ("", "0", "false")


def pytest_collection_modifyitems(config, items):
    """The fast tier: only tests marked `fast` (on the test, its parameter or its module) run; the rest are
    deselected (pytest reports how many). A new test is in the full tier until it is marked: the fast tier's
    minutes are spent on purpose."""
    if full_tier(config): return
    fast = [i for i in items if i.get_closest_marker("fast")]
    config.hook.pytest_deselected(items=[i for i in items if not i.get_closest_marker("fast")])
    items[:] = fast


def pytest_report_header(config):
    return ("tier: full (CI or --full)" if full_tier(config) else
            "tier: fast (tests marked `fast`; `pytest --full` runs everything, as CI does)")
