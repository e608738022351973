"""The trainer's --pp_schedule interleaved, zb, zbv and dualpipev (PyTorch's schedules, lesson 05f's `Chunks`) with
--n_layer: what run.json records, an exact resume, and the depths a schedule cannot split refused before launch.
Each schedule's losses, gradient norms and step 1's gradients against one process: tests/test_paths.py."""
import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import ROOT, run_cli, trainer_cmd
from distcourse.config import ConfigError, parse_args

# 4 steps of the tiny preset made 4 blocks deep (2·pp chunks of one block at pp 2); global batch 4 × 4 × 1
ARGS = ["--config", str(ROOT / "configs/tiny.yaml"), "--n_layer", "4", "--max_steps", "4", "--log_every", "1",
        "--eval_every", "0", "--seq_len", "32", "--batch_size", "4", "--grad_accum", "4", "--max_examples", "300",
        "--tracker", "none"]


def records(out, key):
    return [r[key] for r in map(json.loads, open(out / "metrics.jsonl")) if "split" not in r]


def run(tmp, name, world, flags):
    return run_cli([*trainer_cmd(world, timeout=120), *ARGS, *flags, "--output_dir", str(tmp / name)], timeout=150)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """interleaved on 2 processes (pp 2), saving at steps 2 and 4; then a copy of it without its step-4 checkpoint,
    resumed. (Every schedule's gradients against one process: tests/test_paths.py.)"""
    tmp = tmp_path_factory.mktemp("sched")
    flags = ["--pp", "2", "--pp_schedule", "interleaved", "--save_every", "2"]
    proc = run(tmp, "interleaved", 2, flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.copytree(tmp / "interleaved", tmp / "resumed")
    shutil.rmtree(tmp / "resumed/checkpoints/step_4")
    proc = run(tmp, "resumed", 2, [*flags, "--resume", "latest"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp


def test_schedule_run_records(runs):
    "run.json names the schedule and the depth; a looped schedule's bubble and first-step peak are not measured."
    run = json.loads((runs / "interleaved/run.json").read_text())
    assert run["parallel"]["pp_schedule"] == "interleaved" and run["parallel"]["bubble"] is None  # not timed
    assert run["config"]["n_layer"] == 4 and all("not measured" in r["peak_first_step"]
                                                 for r in run["memory"]["per_rank"])


def test_schedule_resume_is_exact(runs):
    "interleaved's step-2 checkpoint (one process's tensors, each rank its chunks') resumed: steps 3-4 bit for bit."
    meta = dcp.FileSystemReader(str(runs / "resumed/checkpoints/step_2/sharded")).read_metadata().state_dict_metadata
    assert {k.split(".")[1] for k in meta} == {"model", "optimizer"}  # no piece names: any layout reads it
    blocks = {k.split(".")[4] for k in meta if k.startswith("custom_0.model.transformer.h.")}
    assert blocks == {"0", "1", "2", "3"}  # looped: rank r wrote virtual stages r and r + pp, one block each
    for key in ("loss", "grad_norm"): assert records(runs / "resumed", key) == records(runs / "interleaved", key), key
    assert json.loads((runs / "resumed/run.json").read_text())["resumed_from"]["step"] == 2


BAD = [(["--n_layer", "3", "--pp_schedule", "zbv"], "zbv holds v=2 chunks per rank: n_layer=3 does not split into "
        "pp x 2 = 4 equal chunks; use n_layer 4, 8 or 12 (a multiple of 4)"),
       (["--pp_schedule", "interleaved"], "n_layer=2 does not split into pp x 2 = 4"),  # the preset's depth
       (["--n_layer", "4", "--pp_schedule", "dualpipev", "--grad_accum", "2"], "dualpipev needs micro_batches >= 4"),
       (["--n_layer", "4", "--pp_schedule", "interleaved", "--grad_accum", "5"],
        "interleaved needs micro_batches a multiple of its rounds (micro_batches // pp = 2)"),
       (["--n_layer", "4", "--pp_schedule", "zigzag"], "choose one of gpipe, 1f1b, interleaved, zb, zbv, dualpipev")]


@pytest.mark.fast
@pytest.mark.parametrize("flags,msg", BAD)
def test_schedule_refused_before_launch(flags, msg, monkeypatch, tmp_path):
    "Parsing alone refuses them, naming the numbers and the depths or micro-batches that work."
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")) as e:
        parse_args(["--config", str(ROOT / "configs/tiny.yaml"), "--pp", "2", "--grad_accum", "4", *flags,
                    "--output_dir", str(tmp_path / "x")])
    assert not torch.distributed.is_initialized()
    print(e.value)


@pytest.mark.fast
def test_n_layer_presets_only(tmp_path):
    with pytest.raises(ConfigError, match="--n_layer 4: only a preset's depth can change"):
        parse_args(["--model", str(tmp_path), "--n_layer", "4", "--output_dir", str(tmp_path / "x")])


@pytest.mark.fast
def test_schedule_is_not_in_fingerprint():
    "A checkpoint holds one process's tensors, whatever the schedule's pieces: looped chunks resume as a V, or stages."
    from types import SimpleNamespace
    from distcourse.config import Config
    from distcourse.train import fingerprint
    prints = [fingerprint(Config(pp=pp, pp_schedule=s), SimpleNamespace(num_processes=2 * pp))  # dp 2
              for pp in (1, 2) for s in ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev")]
    assert all(p == prints[0] for p in prints), prints