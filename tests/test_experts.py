"MoE GPT and expert parallelism on real processes (gloo): dense equivalence, formulas, equal to one process, bytes."
import json

import numpy as np
import pytest
import torch
from fastcore import test as fc
from torch.utils.flop_counter import FlopCounterMode

from conftest import ROOT, run_worker
from distcourse.experts import (MOE_PRESETS, build_moe, ep_bytes, ep_check_worker, moe_flops_per_token, moe_gpt,
                                moe_params, route)
from distcourse.gpt import GPT, GPTConfig
from distcourse.model import num_params

CFG = GPTConfig(vocab_size=64, n_positions=32, n_layer=2, n_head=2, n_embd=32)
IDS = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(1))


@pytest.mark.fast
def test_one_expert_top1_is_the_dense_gpt():
    "Same seed: outputs, loss and every gradient equal the dense GPT's exactly (the router's gradient is 0)."
    for capacity in (None, 1.0):  # one expert, k=1: capacity 1.0 holds every token, nothing dropped
        torch.manual_seed(0)
        dense = GPT(CFG)
        torch.manual_seed(0)
        moe = moe_gpt(CFG, n_expert=1, top_k=1, capacity_factor=capacity)
        (a, la), (b, lb) = dense(IDS[:, :-1], IDS[:, 1:]), moe(IDS[:, :-1], IDS[:, 1:])
        la.backward()
        lb.backward()
        assert torch.equal(a, b) and torch.equal(la, lb)
        grads = dict(dense.named_parameters())
        for name, p in moe.named_parameters():
            want = torch.zeros_like(p) if "router" in name else grads[name.replace("mlp.experts.0.", "mlp.")].grad
            assert torch.equal(p.grad, want), name


@pytest.mark.fast
@pytest.mark.parametrize("E, k, every, shared", [(4, 2, 1, False), (8, 1, 2, True)])
def test_param_and_flop_formulas(E, k, every, shared):
    "Total = the model's count; active = what one token's backward touches; FLOPs = FlopCounterMode's matmuls."
    model = moe_gpt(CFG, E, k, None, every, shared)
    f = moe_params(CFG, E, k, every, shared)
    assert num_params(model) == f["total"] and f["active"] < f["total"]
    model(IDS[:1, :1], IDS[:1, 1:2])[1].backward()
    assert sum(p.numel() for p in model.parameters() if p.grad.abs().sum() > 0) == f["active"]
    model.zero_grad()
    T = 16
    with FlopCounterMode(display=False) as counter:
        model(IDS[:, :T], IDS[:, 1:T + 1])[1].backward()
    vectors = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 1 and ".experts." not in n)
    vectors += f["moe_layers"] * k * 5 * CFG.n_embd
    matmuls = f["active"] - vectors - CFG.n_positions * CFG.n_embd
    assert counter.get_total_flops() == 6 * matmuls * IDS.size(0) * T  # the CPU SDPA kernel is not counted
    assert moe_flops_per_token(CFG, E, k, T, every, shared) == 6 * (f["active"] - 32 * 32) + 12 * 2 * 32 * T


@pytest.mark.fast
def test_presets():
    for name in MOE_PRESETS:
        p = dict(MOE_PRESETS[name])
        c = GPTConfig(vocab_size=64, **{k: p.pop(k) for k in list(p) if k in GPTConfig.__dataclass_fields__})
        assert num_params(build_moe(name, 64)) == moe_params(c, p["n_expert"], p["top_k"], p["moe_every"])["total"]
    with pytest.raises(ValueError, match="choose one of"): build_moe("tiny_moe", 64)


@pytest.mark.fast
def test_capacity_and_aux():
    probs = torch.full((8, 4), 0.01)
    probs[:, 0] = 0.97  # every token's first choice: expert 0
    idx, gate, keep, aux = route(probs, 1, capacity_factor=1.0, groups=2)
    assert keep[:, 0].tolist() == [True] + [False] * 3 + [True] + [False] * 3  # ⌈1.0 · 4 / 4⌉ = 1 per group
    assert torch.allclose(aux, torch.tensor(4 * 0.97)) and torch.equal(gate[:, 0], probs[:, 0])


def test_ep_equal_to_one_process_and_bytes(tmp_path):
    "One launch of 4: ep=4, and ep=2 on two groups (two copies of each expert); 3 AdamW steps each."
    run_worker("experts", "ep_check_worker", tmp_path, 4, timeout=120, eps=[2, 4])
    res = json.loads((tmp_path / "ep_4.json").read_text())
    assert len(res) == 4
    for ep in ("2", "4"):
        for r in res:
            m = r[ep]
            assert m["out_err"] <= 1e-6 and m["grad_err"] <= 1e-6, (ep, m["out_err"], m["grad_err"])
            want, got = np.array(m["ref"]), np.array(m["ep"])  # per step: loss, gradient norm
            assert len(want) == 3 and (abs(got - want) / want).max() <= 1e-5, (ep, want, got)
            assert m["bytes_fwd"]["a2a_bytes"] + m["bytes_fwd"]["count_bytes"] == m["formula"]
            assert m["bytes"]["grad_a2a_bytes"] == m["bytes"]["a2a_bytes"] > 0
        dropped = sum(sum(a) - sum(b) for r in res for a, b in zip(r[ep]["load"], r[ep]["kept"]))
        assert dropped > 0  # capacity 1.0 drops, and the equality holds with drops


@pytest.mark.fast
def test_bytes_formula_by_hand():
    rows = [[3, 5], [7, 2]]  # rank 0 sends 5 rows to rank 1 and gets 7 from it, returned after the experts
    assert ep_bytes(rows, 0, 2, 16) == (5 + 7) * 16 * 4 + 1 * 2 * 8


@pytest.mark.fast
def test_worker_refuses_before_the_process_group(tmp_path, monkeypatch):
    import torch.distributed as dist
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="ep=3 must divide n_expert=4"): ep_check_worker(tmp_path, eps=[3])
    assert not dist.is_initialized()


@pytest.mark.fast
def test_exercise_checks_refuse_wrong_answers():
    "The lesson's exercise checks, run from the notebook: right answers pass, plausible wrong ones fail."
    nb = json.loads((ROOT / "nbs" / "05j_experts.ipynb").read_text())
    cell = next("".join(c["source"]) for c in nb["cells"] if "def check_active" in "".join(c["source"]))
    scope = {"test_eq": fc.test_eq, "GPTConfig": GPTConfig, "MOE_PRESETS": MOE_PRESETS, "moe_params": moe_params,
             "ep_bytes": ep_bytes, "route": route, "torch": torch}
    exec(cell, scope)
    small = scope["SMALL"]
    scope["check_active"](moe_params(small, 8, 2, moe_every=2)["active"])
    fc.test_fail(lambda: scope["check_active"](moe_params(small, 8, 2, moe_every=2)["total"]), contains="==")
    fc.test_fail(lambda: scope["check_active"](moe_params(small, 8, 1, moe_every=2)["active"]), contains="==")
    scope["check_a2a_bytes"](2 * 8192 * 7 // 8 * 4096 * 2)
    fc.test_fail(lambda: scope["check_a2a_bytes"](8192 * 7 // 8 * 4096 * 2), contains="==")
    fc.test_fail(lambda: scope["check_a2a_bytes"](2 * 8192 * 4096 * 2), contains="==")
    scope["check_capacity"](160)
    fc.test_fail(lambda: scope["check_capacity"](80), contains="==")
