"""The trainer's --model tiny-moe --ep 2 (lesson 05m): the losses, gradient norms and step-1 gradients of one process on
the same global batch, every rank's state bytes as predicted, model/ whole, exact resume, refusals before launch; and
ExpertMesh's step on 4 processes at ep 2, where each expert has a copy in the other ep group."""
import json
import shutil
import re
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import ROOT, grads_diff, run_cli, trainer_cmd, worst_rel
from distcourse.config import ConfigError, parse_args
from distcourse.expert_mesh import ep_trainer_worker, load_moe
from distcourse.experts import MOE_PRESETS, moe_flops_per_token, moe_params
from distcourse.launch import launch

# 8 steps of tiny-moe, global batch 4 x 2 micro-batches; clipping at 1.0 acts (pre-clip norms ~1.4-1.7)
ARGS = ["--config", str(ROOT / "configs/tiny.yaml"), "--model", "tiny-moe", "--max_steps", "8", "--log_every", "1",
        "--eval_every", "0", "--seq_len", "32", "--grad_accum", "2", "--max_examples", "300", "--tracker", "none",
        "--grads_at", "1"]
EP2 = ["--ep", "2", "--batch_size", "2", "--save_every", "4"]  # 2 ranks x 2 rows: the one process's 4 rows
LOSS_TOL = NORM_TOL = 1e-5  # relative, every step (measured 2026-11-26: losses 1.1e-7, norms 1.6e-8)
GRAD_TOL = 1e-6             # step 1's gradients: ‖Δg‖ of a parameter over the whole norm (measured: 7.5e-8)


def train_records(out, key):
    return [r[key] for r in map(json.loads, open(out / "metrics.jsonl")) if "split" not in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    "One process and --ep 2 on 2 processes, side by side (each with a timeout: a hang fails)."
    tmp = tmp_path_factory.mktemp("moe")
    def run(name, world, flags):
        return run_cli([*trainer_cmd(world), *ARGS, *flags, "--output_dir", str(tmp / name)], timeout=300)
    with ThreadPoolExecutor(2) as pool:
        procs = {"one": pool.submit(run, "one", 1, ["--batch_size", "4", "--save_every", "4"]), "ep2": pool.submit(run, "ep2", 2, EP2)}
        for name, proc in procs.items(): assert proc.result().returncode == 0, (name, proc.result().stderr[-3000:])
    return tmp


def test_ep2_equals_one_process(runs):
    "Losses (with aux) and pre-clip norms of every step, step 1's full gradients, model/, run.json's layout."
    one, ep2 = runs / "one", runs / "ep2"
    losses = worst_rel(train_records(one, "loss"), train_records(ep2, "loss"))
    norms = worst_rel(train_records(one, "grad_norm"), train_records(ep2, "grad_norm"))
    grads = grads_diff(one / "grads_step1.pt", ep2 / "grads_step1.pt")  # every expert, under its global index
    print(f"ep 2: losses {losses:.1e}, norms {norms:.1e} over 8 steps, step 1's gradients {grads:.1e}")
    assert len(train_records(ep2, "loss")) == 8
    assert losses <= LOSS_TOL and norms <= NORM_TOL and grads <= GRAD_TOL, (losses, norms, grads)
    a, b = (load_moe(d / "model").state_dict() for d in (one, ep2))  # the whole model, every expert
    assert a.keys() == b.keys()
    diff = sum((b[k] - w).pow(2).sum() for k, w in a.items()).sqrt() / sum(w.pow(2).sum() for w in a.values()).sqrt()
    assert diff <= 1e-4, diff
    run, ref = (json.loads((d / "run.json").read_text()) for d in (ep2, one))
    assert run["parallel"]["dp"] == 2 and run["parallel"]["ep"] == 2 and run["parallel"]["experts_per_rank"] == 2
    for when in ("before", "final"):  # validation through the ep model: every rank its rows, the same numbers
        assert abs(run[when]["loss"] - ref[when]["loss"]) <= 1e-5 * ref[when]["loss"], when
        assert run[when]["samples"] == ref[when]["samples"]


def test_memory_and_flops_as_predicted(runs):
    "Every rank's PARAM, GRAD and OPT peak at step 1 as the formula says: ep 2 holds half the experts."
    runs_json = {n: json.loads((runs / n / "run.json").read_text()) for n in ("one", "ep2")}
    for name, run in runs_json.items():
        want = run["parallel"]["predicted_bytes"]
        for r in run["memory"]["per_rank"]:
            got = r["peak_first_step"]["cpu"]
            assert {k: got[k] for k in ("PARAM", "GRAD", "OPT")} == {k: want[k] for k in ("PARAM", "GRAD", "OPT")}, name
    one, ep2 = (runs_json[n]["parallel"]["predicted_bytes"] for n in ("one", "ep2"))
    assert one["dense_params"] == ep2["dense_params"] and ep2["expert_params"] * 2 == one["expert_params"]
    c = MOE_PRESETS["tiny-moe"]
    cfg = load_moe(runs / "one/model").config
    assert runs_json["ep2"]["num_parameters"] == moe_params(cfg, c["n_expert"], c["top_k"])["total"]
    flops = moe_flops_per_token(cfg, c["n_expert"], c["top_k"], 32, c["moe_every"], c["shared_expert"])
    assert runs_json["one"]["utilisation"]["flops_per_token"] == runs_json["ep2"]["utilisation"]["flops_per_token"] == flops


def test_ep2_resume_is_exact(runs, tmp_path):
    "The ep 2 run without its step-8 checkpoint, resumed from step 4: the same records, bit for bit."
    again = tmp_path / "ep2"
    shutil.copytree(runs / "ep2", again)
    shutil.rmtree(again / "checkpoints/step_8")
    meta = dcp.FileSystemReader(str(again / "checkpoints/step_4/sharded")).read_metadata().state_dict_metadata
    assert {k.split(".")[1] for k in meta} == {"ep0", "ep1"}  # each rank's experts: a piece of its own
    proc = run_cli([*trainer_cmd(2), *ARGS, *EP2, "--resume", "latest", "--output_dir", str(again)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for key in ("loss", "grad_norm"): assert train_records(again, key) == train_records(runs / "ep2", key), key
    assert json.loads((again / "run.json").read_text())["resumed_from"]["step"] == 4


@pytest.mark.fast
@pytest.mark.parametrize("world, flags, says", [
    (2, ["--ep", "2"], "needs a model with experts (n_expert=1); use ep=1"),
    (2, ["--model", "tiny-moe", "--ep", "3"], "experts do not split over 3 ranks"),
    (3, ["--model", "tiny-moe", "--ep", "2"], "does not divide the 3 processes"),
    (4, ["--model", "tiny-moe", "--ep", "2", "--pp", "2"], "composes experts with data and tensor parallelism only"),
    (2, ["--model", "tiny-moe", "--ep", "2", "--zero_stage", "1"], "use --zero_stage 0"),
    (1, ["--model", "tiny-moe", "--task", "cls"], "use --task clm")])
def test_refused_before_launch(world, flags, says, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError, match=re.escape(says)):
        parse_args(["--seq_len", "32", "--output_dir", str(tmp_path), *flags])


def test_copies_on_4_processes(tmp_path):
    "ep 2 on 4 processes: an expert's gradient summed over its copies (ranks r, r + 2); 3 steps equal to one process."
    ep_trainer_worker(tmp_path, ep=1)  # here: no process group, one process, every expert
    launch(partial(ep_trainer_worker, ep=2), (tmp_path,), num_processes=4, timeout=120)  # forked from here
    ref, got = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("ep1_world1", "ep2_world4"))
    losses, norms = worst_rel(ref["loss"], got["loss"]), worst_rel(ref["grad_norm"], got["grad_norm"])
    grads = grads_diff(tmp_path / "ep1_world1.pt", tmp_path / "ep2_world4.pt")
    print(f"4 processes, ep 2: losses {losses:.1e}, norms {norms:.1e}, step 1's gradients {grads:.1e}")
    assert losses <= LOSS_TOL and norms <= NORM_TOL and grads <= GRAD_TOL, (losses, norms, grads)
    for rank in got["per_rank"]: assert {k: rank["predicted"][k] for k in rank["measured"]} == rank["measured"]
