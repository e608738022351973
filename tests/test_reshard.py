"""Resume on another number of processes with the same global batch: 2 -> 1, 2 -> 4 (DDP) and ZeRO-3 4 -> 2;
a rank killed in the middle of a sharded (dcp) save."""
import json
import shutil
import time

import pytest

from conftest import PY, grads_diff, run_cli, run_worker
from distcourse.checkpoint import latest_checkpoint, load_checkpoint
from distcourse.loop import setup
from distcourse.reshard import sharded_weights

STEPS, SAVED, GLOBAL = 14, 6, 16  # 11 steps of 16 examples per epoch: the runs cross an epoch boundary
FIRST = SAVED + 1  # the first step after the resume: every run writes its full gradients there


def steps(out) -> dict:
    "step -> its record (loss, sorted example ids of all ranks, data position) from steps.jsonl."
    return {r["step"]: r for r in map(json.loads, open(out / "steps.jsonl"))}


def resume(straight, dest, processes, **kw) -> dict:
    "Resume a copy of `straight`'s step_6 checkpoint on `processes` processes with the same global batch."
    (dest / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / f"checkpoints/step_{SAVED}", dest / f"checkpoints/step_{SAVED}")
    t0 = time.time()
    run_worker("reshard", "reshard_worker", dest, num_processes=processes, timeout=120,
               **{"batch_size": GLOBAL // processes, "grads_at": FIRST, **kw})
    print(f"resume on {processes} processes: {time.time() - t0:.1f}s")
    return steps(dest)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    "A straight 2-process DDP run (saving at steps 6 and 12), and its step 6 resumed on 1 and on 4 processes."
    tmp = tmp_path_factory.mktemp("ddp")
    run_worker("reshard", "reshard_worker", tmp / "two", timeout=120, batch_size=GLOBAL // 2,
               grads_at=FIRST)
    return tmp / "two", steps(tmp / "two"), {n: resume(tmp / "two", tmp / f"on{n}", n) for n in (1, 4)}


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    "A straight ZeRO-3 run on 4 processes, and its step 6 (one dcp piece per rank) resumed on 2."
    tmp = tmp_path_factory.mktemp("zero3")
    run_worker("reshard", "reshard_worker", tmp / "four", num_processes=4, timeout=120, batch_size=GLOBAL // 4,
               zero_stage=3, grads_at=FIRST)
    pieces = sorted(p.name for p in (tmp / f"four/checkpoints/step_{SAVED}/sharded").iterdir())
    resumed = {2: resume(tmp / "four", tmp / "on2", 2, zero_stage=3)}
    return tmp / "four", steps(tmp / "four"), resumed, pieces


def check_same_run(straight, resumed, world, dirs):  # dirs: the straight and the resumed runs'
    """Losses and pre-clip gradient norms within 1e-5 relative, the first resumed step's full
    gradients within 1e-5, the same examples each step, no example twice or missing in an epoch."""
    assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1))
    assert all(r["world"] == world for r in resumed.values())
    worst = max(abs(resumed[s]["loss"] - straight[s]["loss"]) / abs(straight[s]["loss"]) for s in resumed)
    assert worst <= 1e-5, worst
    norms = max(abs(resumed[s]["grad_norm"] - straight[s]["grad_norm"]) / straight[s]["grad_norm"]
                for s in resumed)
    grads = grads_diff(*(d / f"grads_step{FIRST}.pt" for d in dirs))  # step 7, whole, by name
    print(f"{world} processes: worst relative gradient norm {norms:.1e}, step {FIRST}'s gradients "
          f"{grads:.1e}")
    assert norms <= 1e-5 and grads <= 1e-5, (norms, grads)  # measured: ≤ 6.6e-8 and ≤ 1.4e-7
    assert all(resumed[s]["ids"] == straight[s]["ids"] for s in resumed)  # the same examples, step by step
    joined = {**{s: r for s, r in straight.items() if s <= SAVED}, **resumed}  # what the interrupted job consumed
    epochs = {}
    for s in sorted(joined): epochs.setdefault(joined[s]["epoch"], []).extend(joined[s]["ids"])
    n = len(setup("clm", 16, 32, 80)[1].dataset)  # training examples: max_examples=80 in blocks of 32 tokens
    assert len(epochs[0]) == (n // GLOBAL) * GLOBAL and len(set(epochs[0])) == len(epochs[0])  # no duplicate
    assert len(epochs[1]) == (STEPS - n // GLOBAL) * GLOBAL and len(set(epochs[1])) == len(epochs[1])
    first = [i for s in range(1, STEPS + 1) if straight[s]["epoch"] == 0 for i in straight[s]["ids"]]
    assert sorted(epochs[0]) == sorted(first)  # no gap: every example the straight run used in epoch 0
    return worst


@pytest.mark.parametrize("world", [1, 4])
def test_ddp_resume_on_another_world_size(ddp, world):
    two, straight, resumed = ddp
    worst = check_same_run(straight, resumed[world], world, (two, two.parent / f"on{world}"))
    print(f"2 -> {world}: worst relative loss difference {worst:.1e}")


def test_zero3_resume_four_to_two(zero3):
    four, straight, resumed, pieces = zero3
    assert pieces == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]  # one per rank
    worst = check_same_run(straight, resumed[2], 2, (four, four.parent / "on2"))
    print(f"ZeRO-3 4 -> 2: worst relative loss difference {worst:.1e}")


def test_another_global_batch_is_refused(ddp, tmp_path):
    "The fingerprint holds the global batch: 1 process x 8 is not the saved 2 x 8 = 16, and the error says so."
    with pytest.raises(AssertionError, match="global_batch: saved 16, now 8"):
        resume(ddp[0], tmp_path / "half", 1, batch_size=8)


# Rank 1 is killed right after it wrote its dcp piece of step 12 (rank 0 may or may not have written its own).
DIES_IN_DCP_SAVE = """
import os, signal, sys
from functools import partial
import torch.distributed.checkpoint as dcp
from distcourse.launch import launch
from distcourse.reshard import reshard_worker

save = dcp.save
def save_then_die(state, checkpoint_id=None, **kw):
    save(state, checkpoint_id=checkpoint_id, **kw)
    if str(checkpoint_id).endswith(".tmp-step_12/sharded") and os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
dcp.save = save_then_die
launch(partial(reshard_worker, zero_stage=3, batch_size=8), (sys.argv[1],), num_processes=2, timeout=60)
"""


def test_sigkill_in_a_sharded_save(tmp_path):
    "A rank killed in the middle of a dcp save: the torn save is skipped, the previous one still loads whole."
    script, out = tmp_path / "dies.py", tmp_path / "run"
    script.write_text(DIES_IN_DCP_SAVE)
    proc = run_cli([PY, str(script), str(out)], timeout=120)
    assert proc.returncode != 0
    ckpts = out / "checkpoints"
    assert (ckpts / ".tmp-step_12/sharded/__1_0.distcp").is_file() and not (ckpts / "step_12").exists()
    assert latest_checkpoint(out) == ckpts / f"step_{SAVED}"
    with pytest.raises(ValueError, match="no such directory"): load_checkpoint(None, ckpts / "step_12")
    weights = sharded_weights(ckpts / f"step_{SAVED}")  # every piece of step 6 is there and reads whole
    assert weights["transformer.wte.weight"].shape == (8192, 64)
