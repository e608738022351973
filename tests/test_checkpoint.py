"Checkpoints under real failures: SIGKILL in the middle of a save, a rank killed under torchrun, bad inputs."
import json
import os
import shutil
import signal
import tempfile
from functools import partial
from pathlib import Path

import pytest
import torch

from conftest import PY, run_cli
from distcourse.checkpoint import (MARKER, STATE_FILE, check_output_dir, latest_checkpoint, load_checkpoint,
                                   save_checkpoint)
from distcourse.launch import launch, make_accelerator
from distcourse.resume import resumable_worker

# A tiny run: 9 batches of 8 blocks per epoch on one process, 4 per rank on two.
SIZES = {"max_examples": 30, "batch_size": 8, "seq_len": 32}
worker = partial(resumable_worker, **SIZES)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    "In-process runs use one thread, like each of 2 launched processes on 2 cores (tiny matrices gain nothing)."
    before, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # a user's choice, which make_accelerator keeps
    yield
    torch.set_num_threads(before)
    if omp is None: os.environ.pop("OMP_NUM_THREADS")
    else: os.environ["OMP_NUM_THREADS"] = omp


def losses(out):
    return [json.loads(line) for line in open(out / "losses.jsonl")]


def final(out):
    return json.loads((out / "final.json").read_text())


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    "10 uninterrupted steps on one process: the reference."
    out = tmp_path_factory.mktemp("straight")
    launch(worker, (out, 10), num_processes=1)
    return out


# The child dies from SIGKILL at a known point of the save of step 6: inside Accelerate's save_state
# (the files are in .tmp-step_6), or after the rename to step_6 and before the completion marker.
DIES_IN_SAVE = """
import os, signal, sys
from pathlib import Path
from accelerate import Accelerator
from distcourse.resume import resumable_worker

out, where = sys.argv[1], sys.argv[2]
def die(): os.kill(os.getpid(), signal.SIGKILL)
if where == "save_state":
    save_state = Accelerator.save_state
    def save_state_then_die(self, path, **kwargs):
        save_state(self, path, **kwargs)
        if path.endswith(".tmp-step_6"): die()
    Accelerator.save_state = save_state_then_die
else:
    rename = Path.rename
    def rename_then_die(self, target):
        result = rename(self, target)
        if Path(target).name == "step_6": die()
        return result
    Path.rename = rename_then_die
resumable_worker(out, 10, 3, max_examples=30, batch_size=8, seq_len=32)
"""


@pytest.mark.parametrize("where", ["save_state", "rename"])
def test_sigkill_during_save(where, straight, tmp_path):
    "The previous checkpoint survives, the torn one is skipped and refused, and the run resumes exactly."
    script, out = tmp_path / "dies.py", tmp_path / "run"
    script.write_text(DIES_IN_SAVE)
    proc = run_cli([PY, str(script), str(out), where], env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    ckpts = out / "checkpoints"
    torn = ckpts / ("step_6" if where == "rename" else ".tmp-step_6")
    assert torn.is_dir() and not (torn / MARKER).exists()
    assert latest_checkpoint(out) == ckpts / "step_3"
    with pytest.raises(ValueError, match="incomplete" if where == "rename" else "no such directory"):
        load_checkpoint(None, ckpts / "step_6")
    assert [r["step"] for r in losses(out)] == list(range(1, 7))
    launch(worker, (out, 10, 3), num_processes=1)  # a new job: resumes from step_3
    assert [r["step"] for r in losses(out)] == [*range(1, 7), *range(4, 11)]  # 4-6 trained again
    assert final(out) == final(straight)  # same loss, bit-identical weights
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_3", "step_6", "step_9"]  # torn one gone
    assert (ckpts / "step_6" / MARKER).is_file()


# Rank 1 kills itself with SIGKILL before step 7 in the first attempt (checkpoints at 4 and 8).
KILLS_RANK_1 = """
import os, signal, sys
import distcourse.resume as resume
import distcourse.ddp as ddp  # train_steps, the loop every run uses, calls ddp.train_step

real_step, calls = ddp.train_step, [0]
def train_step(accelerator, *args, **kwargs):
    calls[0] += 1
    if calls[0] == 7 and accelerator.process_index == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    return real_step(accelerator, *args, **kwargs)
ddp.train_step = train_step
resume.main(sys.argv[1:])
"""


# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each attempt gets a fresh store. With the shared one (torch 2.13), a
# restarted gloo rank can read the address the dead rank published and fail ("Connection refused") or hang.
TORCHRUN_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun(*args, restarts=0):
    "`torchrun` with 2 processes on one machine, its rendezvous on a free port (--standalone)."
    return run_cli([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "--max-restarts", str(restarts), *args], env=TORCHRUN_ENV, timeout=300)


def test_killed_rank_restarts_and_matches(tmp_path):
    "torchrun --max-restarts 1 restarts both ranks; they resume from step 4 and end like an uninterrupted run."
    flags = ["--model", "tiny", "--max_steps", "10", "--save_every", "4", "--max_examples", "30",
             "--batch_size", "8", "--seq_len", "32"]
    script = tmp_path / "kills.py"
    script.write_text(KILLS_RANK_1)
    ref = torchrun("-m", "distcourse.resume", "--output_dir", str(tmp_path / "ref"), *flags)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = torchrun(str(script), "--output_dir", str(tmp_path / "killed"), *flags, restarts=1)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "restart 1" in run.stdout and "restart 1" not in ref.stdout
    steps = [r["step"] for r in losses(tmp_path / "killed")]
    assert steps == [*range(1, 7), *range(5, 11)]  # 5 and 6 were lost with the killed job and trained again
    assert final(tmp_path / "killed") == final(tmp_path / "ref")
    assert final(tmp_path / "ref")["step"] == 10


def save_linear(out, steps, keep, fingerprint=None):
    "Checkpoints of a linear layer at `steps`, keeping `keep`."
    acc = make_accelerator()
    acc.prepare(torch.nn.Linear(2, 2))  # registered with the accelerator: save_state writes it
    for step in steps:
        save_checkpoint(acc, out, step, {"data": {"epoch": 0, "batch": step}, "fingerprint": fingerprint or {}}, keep)


def test_keep_prunes_old_torn_and_stale(tmp_path):
    ckpts = tmp_path / "checkpoints"
    (ckpts / ".tmp-step_99").mkdir(parents=True)  # a save that died
    (ckpts / "step_1").mkdir()                    # renamed, never marked
    launch(save_linear, (tmp_path, [2, 4, 6], 2), num_processes=1)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_4", "step_6"]
    state = json.loads((ckpts / "step_6" / STATE_FILE).read_text())
    assert state["step"] == 6 and state["data"] == {"epoch": 0, "batch": 6}
    with pytest.raises(ValueError, match="keep=0"):
        launch(save_linear, (tmp_path, [8], 0), num_processes=1)


def test_bad_checkpoints(tmp_path):
    launch(save_linear, (tmp_path, [5], 3, {"model": "tiny", "seq_len": 32}), num_processes=1)
    path = tmp_path / "checkpoints" / "step_5"
    with pytest.raises(ValueError, match=r"step_7: no such directory.*step_5"):
        load_checkpoint(None, tmp_path / "checkpoints" / "step_7")
    with pytest.raises(ValueError) as e:
        load_checkpoint(None, path, expect={"model": "small", "seq_len": 32, "task": "mlm"})
    assert "model: saved 'tiny', now 'small'" in str(e.value) and "task: saved '<nothing>', now 'mlm'" in str(e.value)
    assert "seq_len" not in str(e.value)
    torn = tmp_path / "checkpoints" / "step_8"
    shutil.copytree(path, torn); (torn / MARKER).unlink()
    assert latest_checkpoint(tmp_path) == path
    with pytest.raises(ValueError, match=r"step_8 is incomplete.*step_5"):
        load_checkpoint(None, torn)

    class Sneaky:
        def __reduce__(self): return (os.system, ("true",))
    torch.save(Sneaky(), path / "custom_checkpoint_0.pkl")
    with pytest.raises(ValueError, match="only load checkpoints you trust"):
        load_checkpoint(None, path)


def test_resume_with_other_config_is_refused(tmp_path):
    launch(worker, (tmp_path, 10, 0, 2), num_processes=1)  # stopped after step 2, saved
    with pytest.raises(ValueError, match="seq_len: saved 32, now 16"):
        launch(partial(resumable_worker, **{**SIZES, "seq_len": 16}), (tmp_path, 10), num_processes=1)
    assert [r["step"] for r in losses(tmp_path)] == [1, 2]  # refused before training


def test_unwritable_output_dir_fails_before_training(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="not writable"):
        launch(worker, (tmp_path / "a_file" / "run", 3), num_processes=1)
    with pytest.raises(ValueError, match="MiB free"):
        check_output_dir(tmp_path / "run", min_free_mb=2**40)
    check_output_dir(tmp_path / "run")


@pytest.fixture
def public_dir():
    "A temporary directory that every user may enter (pytest's tmp_path is private to its owner)."
    path = Path(tempfile.mkdtemp())
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_read_only_output_dir(public_dir):
    "chmod 555; as root (which ignores permission bits) checked in a child that became `nobody`."
    ro = public_dir / "ro"; ro.mkdir(); ro.chmod(0o555)
    if os.geteuid() != 0:
        with pytest.raises(ValueError, match="not writable"):
            check_output_dir(ro / "run")
        return
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setgid(65534); os.setuid(65534)
            try: check_output_dir(ro / "run"); code = 0
            except ValueError as e: code = 1 if "not writable (Permission denied)" in str(e) else 2
        finally: os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 1
