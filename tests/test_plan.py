"""The planner (lessons 09c and 09d): its memory terms are the earlier lessons' functions, its CLI prints a table and
a command the trainer accepts, what cannot run is never listed, the published runs print from the CLI, and an
exercise check refuses a wrong answer."""
import json
import os
import re
import shlex
from dataclasses import replace

import pytest
from accelerate.utils import patch_environment

import distcourse.plan as cli
import distcourse.planner as plan
from distcourse.machine import PROFILES, load_profile
from conftest import ROOT
from distcourse.config import parse_args
from distcourse.gpt import GPT, flops_per_token
from distcourse.memory import zero_bytes
from distcourse.model import num_params
from distcourse.recompute import activation_terms
from distcourse.sizes import n_params, shape_of

pytestmark = pytest.mark.fast  # every test here is quick: in the fast tier

SMALL = shape_of("small", n_layer=4)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_is_zero_bytes(stage):
    mem = plan.memory(SMALL, plan.Layout(4, stage, batch_size=4), 128)
    whole = zero_bytes(num_params(GPT(SMALL.config())), 4, stage)  # 05's model, of 01a's GPT's parameters
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (whole["params"], whole["grads"], whole["optimizer"])


def test_activations_are_05b_terms():
    L = plan.Layout(1, cp=2, batch_size=2)  # the mesh: the course's GPT, 64 tokens of 128 per rank
    block = sum(activation_terms(SMALL.config(), 2, 64, 4, dropout=0.0, attention="flash").values())
    final_norm = 2 * 4 * 2 * 64 * SMALL.n_embd + 8 * 2 * 64
    mem = plan.memory(SMALL, L, 128)
    assert mem["activations"] == SMALL.n_layer * block + final_norm
    assert mem["logits (log-softmax, kept)"] == 4 * 2 * 64 * SMALL.vocab_size
    assert plan.flops_token(SMALL, 128) == flops_per_token(SMALL.config(), 128)


def test_cli_prints_a_table_and_a_command_the_trainer_accepts(capsys, tmp_path):
    rows = cli.main(["--model", "small", "--n_layer", "4", "--world", "4", "--global_batch", "16", "--top", "3"])
    out = capsys.readouterr().out
    table = [l for l in out.splitlines() if re.match(r"\s+\d+ dp\d", l)]
    assert len(table) == 3 and "dominant" in out
    line = out.split("the best:\n")[1].strip()
    words = shlex.split(line)
    # --multi_gpu: without it accelerate launch starts one process on a CPU machine (lesson 02a), whatever --num_processes
    assert words[:6] == ["accelerate", "launch", "--multi_gpu", "--num_processes", "4", "-m"] and words[6] == "distcourse.train"
    with patch_environment(WORLD_SIZE="4"):  # what accelerate launch sets in every rank
        cfg = parse_args(words[7:] + ["--output_dir", str(tmp_path / "run")])
    best = rows[0]["layout"]
    assert (cfg.tp, cfg.pp, cfg.cp, cfg.zero_stage, cfg.batch_size, cfg.grad_accum) == \
        (best.tp, best.pp, best.cp, best.zero_stage, best.batch_size, best.grad_accum)
    assert cfg.batch_size * cfg.grad_accum * best.dp == 16


def test_infeasible_layouts_are_not_enumerated():
    here = load_profile("measured")
    found = plan.layouts(SMALL, 4, 16, 128, here, model="small", n_layer=4)
    assert found and all(L.world == 4 and L.dp * L.grad_accum * L.batch_size == 16 for L in found)
    assert not any(L.tp == 3 for L in found)  # 05c can't split 4 heads 3 ways
    assert any(L.tp > 1 and L.zero_stage == 3 for L in found)  # FSDP2 over the data axes (07c): listed
    assert any(L.tp > 1 and L.zero_stage == 1 for L in found)  # 05a's flat AdamW over the data axes (07c): listed
    assert plan.trainer_accepts(plan.Layout(1, cp=2, batch_size=8), "base", 128)  # the refusal (dropout), said
    base = plan.layouts(shape_of("base"), 4, 16, 128, here, model="base", batch_sizes=(4,))
    assert base and not any(L.pp > 1 or L.cp > 1 for L in base)  # 09 refuses them: base has dropout
    dp4 = [plan.memory(SMALL, L, 128)["total"] for L in found if L.dp == 4 and not L.activation_checkpointing
           and L.batch_size == 16 // 4]
    tight = replace(here, mem_bytes=4 * (min(dp4) + max(dp4)) / 2)  # room for ZeRO 3's ranks, not DDP's
    kept = plan.layouts(SMALL, 4, 16, 128, tight, model="small", n_layer=4, batch_sizes=(4,), recompute=(False,))
    over = [L for L in kept if L.dp == 4 and plan.memory(SMALL, L, 128)["total"] * 4 > tight.mem_bytes]
    assert not over and any(L.dp == 4 for L in kept)


def test_no_stage_without_a_layer():
    "Llama 3 405B's 126 layers on 8,192 GPUs: no pipeline of more (virtual) stages than layers is listed."
    found = plan.layouts(plan.LLAMA3_405B, 8192, 2048, 8192, PROFILES["h100-node"], zero_stages=(1,),
                         schedules=("1f1b", "interleaved"), cp_impls=("ring",), batch_sizes=(1,), recompute=(True,))
    v = lambda L: 2 if L.pp_schedule == "interleaved" else 1
    assert found and all(L.pp * v(L) <= 126 for L in found)
    assert any(L.pp == 64 and v(L) == 1 for L in found) and not any(L.pp == 64 and v(L) == 2 for L in found)


def test_published_runs_print_from_the_cli(capsys, monkeypatch):
    "--published: 09c's comparison, each prediction the planner's own for the published degrees' best variant."
    runs = plan.published_runs()
    assert len(runs) == 13 and sum(r[-1] == "TFLOP/s" for r in runs) == 10  # Megatron-LM's rows, Llama 3's three
    monkeypatch.setattr(plan, "published_runs", lambda: [runs[0], runs[3]])  # one of each: the lesson prints all
    rows = cli.main(["--published"])
    out = capsys.readouterr().out
    assert len(rows) == 2 and "Llama 3 405B, 8K" in out and "Megatron 1.7B" in out
    assert "mean |error|: Megatron-LM's 1 rows" in out
    for r, (name, s, world, batch, seq, prof, deg, reported, what) in zip(rows, (runs[0], runs[3])):
        L = next(L for L in plan.layouts(s, world, batch, seq, prof, zero_stages=(0, 1, 2),
                                         schedules=("1f1b", "interleaved"), cp_impls=("ring",), batch_sizes=(1,),
                                         recompute=(True,) if what == "TFLOP/s" else (False, "selective", True))
                 if str(L) == r["layout"])
        assert (L.dp, L.tp, L.pp, L.cp) == deg and r["reported"] == reported
        mfu = plan.predict(s, L, seq, prof)["mfu"]
        assert r["pred"] == pytest.approx(mfu * (prof.flops * 4 / 3 if what == "TFLOP/s" else 1))
        assert r["error"] == pytest.approx(r["pred"] / reported - 1) and f"{r['error']:+.0%}" in out


def test_exercise_check_refuses_a_wrong_answer():
    nb = json.loads((ROOT / "nbs" / "09c_plan.ipynb").read_text())
    code = next("".join(c["source"]) for c in nb["cells"] if "def check_model_state" in "".join(c["source"]))
    ns = dict(vars(plan))
    exec(code, ns)
    s = plan.Shape("llama3-405b", 126, 16384, 128, 128000, n_positions=0, d_ff=53248, n_kv_head=8, megatron=True)
    mem = plan.memory(s, plan.Layout(64, 1, 8, 16, "1f1b", 32), 8192, "bf16")
    ns["check_model_state"](mem["params"] + mem["grads"] + mem["optimizer"])
    whole = 16 * plan.rank_params(s, plan.Layout(64, 1, 8, 16))  # nothing sharded over dp: 2 + 2 + 12 bytes each
    with pytest.raises(AssertionError, match="not yet"): ns["check_model_state"](whole)


def test_shared_cores_count_the_machines_work():
    here = load_profile("measured")
    pp4, even = plan.Layout(1, pp=4, grad_accum=8, batch_size=2), plan.Shape("even", 8, 256, 4, vocab_size=64)
    # a waiting stage gives its core to another process: no idle time on 4 processes of 2 cores, unlike on GPUs;
    # (with `small`'s 8,192-word output layer the last stage is the slowest rank, and that shows as "bubble")
    assert plan.step_time(even, pp4, 128, here)["bubble"] == 0 < plan.step_time(even, pp4, 128, PROFILES["h100-node"])["bubble"]
    assert plan.step_time(SMALL, pp4, 128, here)["bubble"] > 0
    ddp, zero1 = (plan.step_time(SMALL, plan.Layout(4, z, batch_size=4), 128, here) for z in (0, 1))
    adamw = n_params(SMALL)["total"] * here.adamw_s  # DDP: every rank updates every parameter; ZeRO 1: a quarter
    assert ddp["compute"] - zero1["compute"] == pytest.approx(3 * adamw / min(here.cores, 4))


def _count_worker(out, hf):
    "Worker: one Mesh step at dp 2 x cp 2, every all_reduce call recorded as (group size, numbers); rank 0 writes."
    import copy
    from types import SimpleNamespace
    import torch
    import torch.distributed as dist
    from distcourse.mesh import Mesh
    dist.init_process_group("gloo")
    args = SimpleNamespace(tp=1, pp=1, cp=2, cp_impl="ring", lr=1e-3, weight_decay=0.1, warmup_steps=1, max_steps=1,
                           pp_schedule="1f1b")
    mesh, calls, real = Mesh(copy.deepcopy(hf), args), [], dist.all_reduce
    def counted(t, *a, group=None, **k):
        calls.append((dist.get_world_size(group), t.numel()))
        return real(t, *a, group=group, **k)
    x = torch.randint(0, 100, (4, 32), generator=torch.Generator().manual_seed(0))
    dist.all_reduce = counted
    try: list(mesh.train_steps(iter([{"input_ids": x, "labels": x.clone()}]), 1))
    finally: dist.all_reduce = real
    if dist.get_rank() == 0: (out / "calls.json").write_text(json.dumps(calls))
    dist.barrier()
    dist.destroy_process_group()


def test_the_planner_counts_the_meshs_gradient_calls(tmp_path):
    "The shared model prices each call the trainer makes: 05k's Mesh sums the gradients in buckets over dp x cp."
    from functools import partial
    from transformers import GPT2Config, GPT2LMHeadModel
    from distcourse.launch import launch
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=64, n_layer=2, n_head=4, n_embd=64, resid_pdrop=0,
                                    embd_pdrop=0, attn_pdrop=0))
    launch(partial(_count_worker, hf=hf), (tmp_path,), num_processes=4, timeout=180)
    calls = json.loads((tmp_path / "calls.json").read_text())
    buckets = [c for c in calls if c[0] == 4]  # over dp x cp (4 ranks): the gradients and the loss sum, flat
    s, L = plan.Shape("t", 2, 64, 4, 100, 64), plan.Layout(2, cp=2, batch_size=2)
    want = plan.dp_messages(s, L, 4 * plan.rank_params(s, L))
    assert [(c, n) for c, _, n, _ in want] == [("all_reduce", 4), ("all_reduce", 4)]
    assert len(buckets) == sum(k for *_, k in want) == 2
    # every gradient in one bucket (03's Reducer, launched from backward), then the loss sum
    assert [n for _, n in buckets] == [sum(p.numel() for p in hf.parameters()), 1]
