"""Faults injected, faults caught: each known fault, written into a fresh copy of the package,
makes the smallest equivalence check that must see it fail; the same check passes on the package as
it is.

Every check compares a few steps of the `tiny` model with one process on the same global batch (or
a straight run with its resumed copy): per-step loss and gradient norm before clipping. A loss
alone cannot see a gradient scaled by a constant (AdamW and clipping absorb it); a norm can."""
import json
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import pytest

from conftest import PY, ROOT, copy_env, fresh_copy, run_cli, trainer_cmd

TIMEOUT = 240  # seconds per launch: a hang fails
# 3 steps of the tiny model; the global batch is 4 x 2 sequences of 32 tokens in every layout below
ARGS = ["--config", str(ROOT / "configs/tiny.yaml"), "--max_steps", "3", "--log_every", "1",
        "--eval_every", "0", "--seq_len", "32", "--max_examples", "200", "--tracker", "none"]
ONE = ["--batch_size", "4", "--grad_accum", "2", "--save_every", "1"]  # reference; saved: resume
LOSS_TOL = NORM_TOL = 1e-5  # relative, per step (every path's norm is the root of summed squares)
# check name -> (processes, flags): the trainer CLI against the reference
HALF, WHOLE = ["--batch_size", "2", "--grad_accum", "2"], ["--batch_size", "4", "--grad_accum", "2"]
LAYOUTS = {"dp2": (2, HALF),  # 2 replicas of 2 x 2 sequences
           "zero1": (2, ["--zero_stage", "1", *HALF]),
           "tp2": (2, ["--tp", "2", *WHOLE]),  # one tp pair: 4 x 2 sequences
           "cp2": (2, ["--cp", "2", *WHOLE]),
           "pp2": (2, ["--pp", "2", "--pp_schedule", "1f1b", *WHOLE])}
CHECKS = [*LAYOUTS, "zero2_by_hand", "resume"]


def fault(name, module, old, new, check, what):  # old: text that occurs exactly once in the module
    "One fault: replace `old` by `new` in distcourse/<module>.py; `check` must then fail."
    return dict(name=name, module=module, old=old, new=new, check=check, what=what)


FAULTS = [
    fault("dp: mean where sum", "ddp", "scale = accelerator.num_processes * accelerator.grad",
          "scale = accelerator.grad", "dp2", "DDP's mean over ranks not undone (x N dropped)"),
    fault("dp: sum where mean", "zero", "reduce_scatter_single(out, flat.div_(self.world), group",
          "reduce_scatter_single(out, flat, group", "zero2_by_hand",
          "ZeRO-2 by hand reduce-scatters the sum of the ranks' mean gradients"),
    fault("tp: mean where sum", "tensor_parallel",
          'return all_reduce_(grad.contiguous(), ctx.group, "backward", ctx.log), None, None',
          'return all_reduce_(grad.contiguous(), ctx.group, "backward", ctx.log)'
          " / dist.get_world_size(ctx.group), None, None", "tp2",
          "f's backward all-reduce divided by tp"),
    fault("tp: sum where mean", "tensor_parallel",  # g keeps its group for the backward
          "def forward(ctx, x, group, log): "
          'return all_reduce_(x.contiguous(), group, "forward", log)'
          "\n    @staticmethod\n    def backward(ctx, grad): return grad, None, None",
          "def forward(ctx, x, group, log):\n        ctx.group = group\n"
          '        return all_reduce_(x.contiguous(), group, "forward", log)\n    @staticmethod\n'
          "    def backward(ctx, grad): "
          'return all_reduce_(grad.clone(), ctx.group, "backward", None), None, None',
          "tp2", "g's backward sums the tp ranks' equal copies of the gradient"),
    fault("cp: mean where sum", "mesh", "    if on_grads: on_grads(self)\n",
          '    for g in grads: g.div_(self.d["cp"])\n    if on_grads: on_grads(self)\n', "cp2",
          "the chunks' gradients averaged over cp"),
    fault("cp: sum where mean", "mesh", "    sq = split + whole\n",
          '    sq = split + whole\n'
          '    if self.d["cp"] > 1: dist.all_reduce(sq, group=self.g["cp"])\n',
          "cp2", "the norm's squares summed over cp ranks that each hold the whole gradient"),
    fault("pp: mean where sum", "pipeline", "dist.all_reduce(weight.grad, group=groups.embed)",
          "dist.all_reduce(weight.grad, group=groups.embed); weight.grad.div_(2)", "pp2",
          "the tied matrix's two stage gradients averaged"),
    fault("pp: sum where mean", "mesh", '(pp > 1 and n.endswith("lm_head.weight"))', "False", "pp2",
          "the tied matrix's squares summed over first and last stage (counted twice)"),
    fault("local token count", "ddp", 'n = accelerator.reduce(local.to(accelerator.device), "sum")',
          "n = local.to(accelerator.device)", "dp2", "loss divided by this rank's tokens"),
    fault("micro-batch dropped", "ddp", "micro = [next(batches) for _ in range(grad_accum)]",
          "micro = [next(batches) for _ in range(grad_accum)][1:]", "dp2",
          "each step's first micro-batch read but not trained on"),
    fault("tied sync removed", "pipeline", "dist.all_reduce(weight.grad, group=groups.embed)",
          "pass", "pp2", "wte (first stage) and lm_head (last) keep their own gradients"),
    fault("zig-zag shifted", "context_parallel",
          "return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in ids])",
          "return (torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in ids]) + c) % T", "cp2",
          "every rank's positions one chunk later (mod T)"),
    fault("ZeRO shard offset", "zero",
          "lo, hi = self.rank * s.numel(), (self.rank + 1) * s.numel()",
          "lo, hi = self.rank * s.numel() + 1, (self.rank + 1) * s.numel() + 1", "zero1",
          "ZeRO-1 by hand: every rank's slice one element late"),
    fault("resume data off by one", "checkpoint",
          "self.epoch, self.batch, self._it = epoch, batch, None",
          "self.epoch, self.batch, self._it = epoch, batch + 1, None", "resume",
          "a resumed stream skips one batch"),
]
ROWS = []  # (fault, check, verdict, measured): the table printed after the module


def records(out) -> list:
    "Step, loss, gradient norm and tokens of each train record of a run's metrics.jsonl."
    keys = ("step", "loss", "grad_norm", "tokens")
    return [{k: r[k] for k in keys} for r in map(json.loads, open(Path(out) / "metrics.jsonl"))
            if "split" not in r]


def run_trainer(out, world, flags, repo=ROOT, env=None, resume=False):
    "The trainer on `world` processes of `repo`'s package; None when it ran, else why it did not."
    cmd = [*trainer_cmd(world, TIMEOUT), *ARGS, *flags, "--output_dir", str(out)]
    return _run(cmd + (["--resume", "latest"] if resume else []), repo, env)


def _run(cmd, repo, env):
    "Run `cmd` in `repo`; None when it exited 0, else the reason (exit code and last stderr line)."
    try: proc = run_cli(cmd, cwd=repo, timeout=TIMEOUT, env=env)  # `repo`: its package imported
    except subprocess.TimeoutExpired: return f"timed out after {TIMEOUT} s"
    if proc.returncode == 0: return None
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    return f"exit {proc.returncode}: {last[:120]}"


def compare(want, got, exact=False) -> tuple:  # want, got: lists of train records
    "(equal, what was measured): per-step losses and grad norms of `got` against `want`."
    if [r["step"] for r in got] != [r["step"] for r in want]:
        return "differ", f"steps {[r['step'] for r in got]}, want {[r['step'] for r in want]}"
    loss = max(abs(g["loss"] - w["loss"]) / abs(w["loss"]) for w, g in zip(want, got))
    diffs = [abs(g["grad_norm"] - w["grad_norm"]) / w["grad_norm"] for w, g in zip(want, got)]
    worst = diffs.index(max(diffs))
    ratio = got[worst]["grad_norm"] / want[worst]["grad_norm"]
    what = f"grad_norm ratio {ratio:.6f} (step {got[worst]['step']}), loss rel diff {loss:.1e}"
    if exact: equal, what = got == want, what + (", bit for bit" if got == want else ", not exact")
    else: equal = loss <= LOSS_TOL and max(diffs) <= NORM_TOL
    return "equal" if equal else "differ", what


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    "One process on the unmutated package: what every check compares with (saved at every step)."
    out = tmp_path_factory.mktemp("mutation") / "one"
    failed = run_trainer(out, 1, ONE)
    assert failed is None, f"the one-process reference run failed: {failed}"
    return out


def zero2_by_hand(tmp, repo, env) -> tuple:
    "ZeRO-2 by hand (FlatZero2Optimizer) against DDP on the same batches in one run: losses, norms."
    code = ("import sys; from functools import partial; from distcourse.launch import launch; "
            "from distcourse.zero import zero_worker as w; "
            "launch(partial(w, stages=[0, 2], zero2='flat', steps=3, batch_size=4, seq_len=32, "
            "max_examples=200, grad_accum=2), (sys.argv[1],), num_processes=2)")
    if failed := _run([PY, "-c", code, str(tmp)], repo, env): return "failed", failed
    res = json.loads((tmp / "zero.json").read_text())
    want, got = ([{"step": i + 1, "loss": loss, "grad_norm": norm}
                  for i, (loss, norm) in enumerate(zip(res[s]["losses"], res[s]["grad_norms"]))]
                 for s in ("0", "2"))
    return compare(want, got)


def resume(tmp, repo, env, reference) -> tuple:
    "The reference without its step-2 and step-3 checkpoints, resumed: steps 2-3 repeat exactly."
    again = tmp / "again"
    shutil.copytree(reference, again)
    for step in (2, 3): shutil.rmtree(again / f"checkpoints/step_{step}")
    if failed := run_trainer(again, 1, ONE, repo, env, resume=True): return "failed", failed
    return compare(records(reference), records(again), exact=True)


def run_check(name, tmp, reference, repo=ROOT, env=None) -> tuple:
    "('equal' | 'differ' | 'failed' (the run did not finish), what was measured) for check `name`."
    if name == "zero2_by_hand": return zero2_by_hand(tmp, repo, env)
    if name == "resume": return resume(tmp, repo, env, reference)
    world, flags = LAYOUTS[name]
    if failed := run_trainer(tmp / name, world, flags, repo, env): return "failed", failed
    return compare(records(reference), records(tmp / name))


@pytest.fixture(scope="module", autouse=True)
def table(request):
    "After the module: every fault, the check that ran on it and what it measured."
    yield
    capture = request.config.pluginmanager.get_plugin("capturemanager")  # printed even under -q
    with capture.global_and_fixture_disabled() if capture else nullcontext():
        print("\n\nfault -> check -> verdict: measured")
        for row in ROWS: print("{:42} -> {:13} -> {}: {}".format(*row))


@pytest.fixture(scope="module")
def outcomes(request, reference, tmp_path_factory):
    """The selected checks on the package as it is and with each selected fault, two runs at a time (a run is
    mostly imports and process starts, one core each): {("check" | "fault", name): (verdict, what)}."""
    items = [i for i in request.session.items if i.module is request.module and hasattr(i, "callspec")]
    jobs = [("check", i.callspec.params["name"], None) for i in items
            if i.originalname == "test_check_passes_unmutated"]
    jobs += [("fault", i.callspec.params["f"]["name"], i.callspec.params["f"]) for i in items
             if i.originalname == "test_fault_is_caught"]
    def one(kind, name, f):
        tmp = tmp_path_factory.mktemp("check")
        try:
            if f is None: return run_check(name, tmp, reference)
            repo = fresh_copy(tmp / "repo")
            mutate(repo, f)
            return run_check(f["check"], tmp, reference, repo, copy_env(repo))
        except Exception as e: return "error", e  # raised by its own test
    with ThreadPoolExecutor(2) as pool:
        futures = {(kind, name): pool.submit(one, kind, name, f) for kind, name, f in jobs}
        return {key: future.result() for key, future in futures.items()}


def outcome(outcomes, key) -> tuple:
    verdict, what = outcomes[key]
    if verdict == "error": raise what
    return verdict, what


FAST = {"dp2", "tp2", "resume", "dp: mean where sum", "tp: sum where mean", "resume data off by one"}  # fast tier


def tiered(values, ids):
    "Parameters, those named in FAST marked for the fast tier."
    return [pytest.param(v, id=i, marks=[pytest.mark.fast] if i in FAST else []) for v, i in zip(values, ids)]


@pytest.mark.parametrize("name", tiered(CHECKS, CHECKS))
def test_check_passes_unmutated(name, outcomes):
    "A check that always failed would prove nothing: on the package as it is, each one passes."
    verdict, what = outcome(outcomes, ("check", name))
    ROWS.append(("(none)", name, "passes" if verdict == "equal" else f"FAILS ({verdict})", what))
    assert verdict == "equal", f"{name} fails on the unmutated package: {what}"


def mutate(repo, f):  # f: one of FAULTS
    "Write fault `f` into `repo`'s copy of distcourse/<module>.py; its text must occur once."
    path = repo / "distcourse" / f"{f['module']}.py"
    text = path.read_text()
    found = text.count(f["old"])
    assert found == 1, (f"fault {f['name']!r}: its text occurs {found} times in "
                        f"distcourse/{f['module']}.py, not once: the code changed, so update this "
                        f"fault in tests/test_mutation.py (old: {f['old']!r})")
    text = text.replace(f["old"], f["new"])
    compile(text, str(path), "exec")  # a fault is wrong arithmetic, never a syntax error
    path.write_text(text)


@pytest.mark.parametrize("f", tiered(FAULTS, [f["name"] for f in FAULTS]))
def test_fault_is_caught(f, outcomes):
    "The fault, written into a fresh copy of the package, makes its check's numbers differ."
    verdict, what = outcome(outcomes, ("fault", f["name"]))
    shown = {"differ": "caught", "equal": "NOT CAUGHT", "failed": "RUN FAILED"}[verdict]
    ROWS.append((f"{f['name']} ({f['module']}.py)", f["check"], shown, what))
    # A fault is wrong arithmetic: a crash or a hang would prove nothing about the comparison.
    assert verdict != "failed", (f"fault {f['name']!r} made the run fail ({what}) instead of "
                                 "changing its numbers: update it in tests/test_mutation.py")
    assert verdict == "differ", f"{f['name']!r} ({f['what']}) not caught by {f['check']}: {what}"
