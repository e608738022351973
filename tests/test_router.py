"""Lesson 05jb's routers: the softmax one equal to 05j's layer; DeepSeek-V3's sigmoid gates, bias and
sequence-wise loss against their formulas; ST-MoE's z-loss; the trainer's --router and --dropless flags, their
refusals, their records and an exact resume. (Equal to one process under --ep 2: tests/test_mutation.py.)"""
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, run_cli, trainer_cmd
from distcourse.config import ConfigError, parse_args
from distcourse.expert_mesh import load_moe
from distcourse.experts import AUX_WEIGHT, aux_loss, build_moe, fits, moe_layers, route
from distcourse.router import (BIAS_RATE, SEQ_AUX, Z_WEIGHT, ROUTERS, RouterMoE, balance_loss, balance_step,
                               bias_step, build_router_moe, router_loss, z_loss)

pytestmark = pytest.mark.fast
TINY = ["--config", str(ROOT / "configs/tiny.yaml")]


def v3_balance(scores, idx, T):
    "DeepSeek-V3's eqs. 17-20 for one sequence of T tokens, written out: Σ_i f_i P_i (before α)."
    E, k = scores.size(1), idx.size(1)
    f = torch.tensor([E / (k * T) * (idx == i).any(-1).sum().item() for i in range(E)])
    p = (scores / scores.sum(-1, keepdim=True)).mean(0)
    return (f * p).sum().item()


def test_softmax_router_is_05js_layer():
    x = torch.randint(0, 300, (3, 17))
    torch.manual_seed(2); old = build_moe("tiny-moe", 300)
    torch.manual_seed(2); new = build_router_moe("tiny-moe", 300, "softmax")
    for m in (old, new): (m(x[:, :-1], x[:, 1:])[1] + AUX_WEIGHT * aux_loss(m)).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(old.parameters(), new.parameters()))
    assert torch.equal(router_loss(old), router_loss(new))
    assert "transformer.h.0.mlp.expert_bias" not in new.state_dict()  # 05j's checkpoints load into it


def test_sigmoid_gates_sum_to_one_and_carry_no_bias():
    torch.manual_seed(0)
    layer = moe_layers(build_router_moe("tiny-moe", 300, "deepseek"))[0]
    h = torch.randn(40, 64)
    s = torch.sigmoid(layer.router(h).float())
    layer.expert_bias[:] = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 in every token's top 2
    idx, gate, keep = layer._route(h)
    assert (idx == 3).any(-1).all()
    torch.testing.assert_close(gate, s.gather(-1, idx) / s.gather(-1, idx).sum(-1, keepdim=True))
    torch.testing.assert_close(gate.sum(-1), torch.ones(40))
    assert "transformer.h.0.mlp.expert_bias" in build_router_moe("tiny-moe", 300, "deepseek").state_dict()


@pytest.mark.parametrize("groups", [1, 4])
def test_balance_loss_is_deepseek_v3s_formula(groups):
    g = torch.Generator().manual_seed(3)
    scores = torch.sigmoid(torch.randn(32, 4, generator=g) * 2)
    idx = scores.topk(2, -1).indices
    T = 32 // groups
    want = sum(v3_balance(scores[i * T:(i + 1) * T], idx[i * T:(i + 1) * T], T) for i in range(groups)) / groups
    assert math.isclose(balance_loss(scores, idx, groups).item(), want, rel_tol=1e-6)
    assert math.isclose(balance_loss(torch.full((8, 4), 0.3), torch.tensor([[0, 1], [2, 3]] * 4)).item(), 1.0)
    one_hot = torch.tensor([[1.0, 1e-9, 1e-9, 1e-9]] * 8)  # every token's score and choice on expert 0 (k = 1)
    assert math.isclose(balance_loss(one_hot, torch.zeros(8, 1, dtype=torch.long)).item(), 4.0, rel_tol=1e-6)


def test_bias_step_and_balance_step():
    assert bias_step(torch.tensor([30, 10, 20, 20]), 1e-3).tolist() == pytest.approx([-1e-3, 1e-3, 0, 0])
    torch.manual_seed(0)
    net = build_router_moe("tiny-moe", 300, "deepseek")
    net(torch.randint(0, 300, (4, 16)))
    layers = moe_layers(net)
    chosen = [m.tally[0].clone() for m in layers]
    assert all(c.sum() == 4 * 16 * 2 for c in chosen)  # every token's 2 choices counted
    out = balance_step(net)
    want = max((c.max() / c.float().mean()).item() for c in chosen)
    assert out["imbalance"] == pytest.approx(want) and 0 <= out["dropped"] < 1
    for m, c in zip(layers, chosen):
        assert torch.equal(m.expert_bias, bias_step(c, BIAS_RATE)) and not m.tally.any()
    net.eval(); net(torch.randint(0, 300, (4, 16)))
    assert not any(m.tally.any() for m in layers)  # evaluation is not counted


def test_z_loss_and_the_routers_weights():
    logits = torch.randn(16, 4) * 3
    assert z_loss(logits).item() == pytest.approx(torch.logsumexp(logits, -1).pow(2).mean().item())
    x = torch.randint(0, 300, (2, 9))
    for name, (aux_w, z_w) in {"softmax": (AUX_WEIGHT, 0), "st-moe": (AUX_WEIGHT, Z_WEIGHT),
                               "deepseek": (SEQ_AUX, 0)}.items():
        torch.manual_seed(0)
        net, logits = build_router_moe("tiny-moe", 300, name), []
        for m in moe_layers(net): m.router.register_forward_hook(lambda mod, args, out: logits.append(out))
        net(x)
        want = sum(aux_w * m.aux + z_w * z_loss(z) for m, z in zip(moe_layers(net), logits))
        assert router_loss(net).item() == pytest.approx(want.item(), rel=1e-6), name
    assert set(ROUTERS) == {"softmax", "st-moe", "deepseek"}


def test_dropless_keeps_every_token():
    idx = torch.tensor([[0]] * 5 + [[1], [2], [3]])
    assert (~fits(idx, 4, 1.0)).sum() == 3 and fits(idx, 4, None).all()
    torch.manual_seed(0)
    net = build_router_moe("tiny-moe", 300, "deepseek", dropless=True)
    assert all(m.capacity_factor is None for m in moe_layers(net))
    net(torch.randint(0, 300, (4, 16)))
    assert balance_step(net)["dropped"] == 0


def test_flags_refused_without_experts():
    with pytest.raises(ConfigError, match="--model tiny has no experts; pass --model tiny-moe"):
        parse_args([*TINY, "--router", "deepseek"])
    with pytest.raises(ConfigError, match="has no experts"):
        parse_args([*TINY, "--dropless"])
    with pytest.raises(ConfigError, match="--router 'deepseak' .did you mean deepseek"):
        parse_args([*TINY, "--model", "tiny-moe", "--router", "deepseak"])
    cfg = parse_args([*TINY, "--model", "tiny-moe", "--router", "st-moe", "--dropless"])
    assert (cfg.router, cfg.dropless) == ("st-moe", True)


ARGS = [*TINY, "--model", "tiny-moe", "--router", "deepseek", "--max_steps", "4", "--log_every", "1",
        "--eval_every", "0", "--seq_len", "32", "--max_examples", "200", "--tracker", "none", "--batch_size", "4"]


def test_trainer_records_the_load_and_resumes_the_bias_exactly(tmp_path):
    "Every train record carries imbalance and dropped; the bias is saved with the weights and a resume repeats."
    run = lambda out, *more: run_cli([*trainer_cmd(1), *ARGS, "--output_dir", str(out), *more], timeout=300)
    assert (p := run(tmp_path / "a", "--save_every", "2")).returncode == 0, p.stderr[-2000:]
    recs = [json.loads(l) for l in open(tmp_path / "a/metrics.jsonl") if '"split"' not in l]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(r["imbalance"] >= 1 and 0 <= r["dropped"] < 1 for r in recs)
    model = load_moe(tmp_path / "a/model")
    bias = model.transformer.h[0].mlp.expert_bias
    assert isinstance(model.transformer.h[0].mlp, RouterMoE) and bias.abs().max() == pytest.approx(4 * BIAS_RATE)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b/checkpoints/step_4")
    assert (p := run(tmp_path / "b", "--save_every", "2", "--resume", "latest")).returncode == 0, p.stderr[-2000:]
    again = [json.loads(l) for l in open(tmp_path / "b/metrics.jsonl") if '"split"' not in l]
    assert [(r["loss"], r["grad_norm"], r["imbalance"]) for r in again if r["step"] > 2] == \
        [(r["loss"], r["grad_norm"], r["imbalance"]) for r in recs if r["step"] > 2]
    for k, v in load_moe(tmp_path / "b/model").state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
