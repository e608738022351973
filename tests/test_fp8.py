"""FP8 numerics (lesson 04c): quantisation per tensor, row and block, at the edges (blocks cut short, an all-zero
block, saturation); delayed scaling's clamp on a jump; the FP8 matmul's three products against fp32's, neither
exact nor far; `fp8_linears` swaps only the blocks' matmuls, sharing their weights; the float8 all-gather on 2 and
4 real processes gathers the bytes one process's quantisation gives, at half bf16's payload. (The all-gather
with each rank's own amax is a planted fault in tests/test_mutation.py, caught by its `fp8 gather` check.)"""
import json

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from conftest import run_worker
from distcourse.fp8 import (RECIPES, DelayedScale, FP8Linear, FP8Matmul, block_amax, clamped, dequantize,
                            fp8_linears, fp8_max, quantize)
from distcourse.model import build_model


def rel(a, b): return ((a - b).norm() / b.norm()).item()


@pytest.mark.fast
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_quantize_keeps_each_blocks_amax_and_the_formats_error(recipe):
    torch.manual_seed(0)
    x = torch.randn(130, 300)  # not multiples of 128: blocks at the edges are cut short
    for key in ("x", "w"):
        block = RECIPES[recipe][key]
        q, s = quantize(x, block)
        br, bc = min(block[0], 130), min(block[1], 300)
        assert q.dtype == torch.float8_e4m3fn and s.shape == (-(-130 // br), -(-300 // bc))
        back = dequantize(q, s, block)
        torch.testing.assert_close(block_amax(back, block), block_amax(x, block), rtol=1e-6, atol=0)
        assert 0.01 < rel(back, x) < 0.04  # e4m3's own error: not exact, not lost


@pytest.mark.fast
def test_zero_blocks_and_saturation_give_no_nan():
    x = torch.zeros(4, 256)
    x[:, 128:] = torch.randn(4, 128)  # the first 1 x 128 block of every row is all zeros
    q, s = quantize(x, RECIPES["block"]["x"])
    assert torch.isfinite(s).all() and (q.float()[:, :128] == 0).all()
    q, _ = quantize(torch.tensor([[1e6, -1e6, 1.0]]), scale=torch.ones(1, 1))  # far past 448: clamped
    assert q.float().tolist() == [[448.0, -448.0, 1.0]]
    q, _ = quantize(torch.tensor([[1e6, 1.0]]), fmt="e5m2", scale=torch.ones(1, 1))
    assert q.float()[0, 0].item() == fp8_max("e5m2")


@pytest.mark.fast
def test_delayed_scaling_clamps_a_jump_current_does_not():
    torch.manual_seed(0)
    delayed = DelayedScale(history=4)
    for _ in range(5): delayed(torch.randn(64, 64))
    spike = torch.randn(64, 64) * 8
    assert clamped(spike, delayed(spike)) > 0.3 and clamped(spike, quantize(spike)[1]) == 0
    assert len(delayed.amaxes) == 4  # the window, not the whole history


@pytest.mark.fast
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_matmul_is_near_fp32_and_not_fp32(recipe):
    torch.manual_seed(0)
    x, w, g = torch.randn(64, 256), torch.randn(256, 192) * 0.05, torch.randn(64, 192)
    got, want = [], []
    for mm, out in ((lambda a, b: FP8Matmul.apply(a, b, recipe, "e5m2"), got), (lambda a, b: a @ b, want)):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = mm(a, b); y.backward(g)
        out += [y.detach(), a.grad, b.grad]
    errs = [rel(p, q) for p, q in zip(got, want)]
    assert all(0.01 < e < 0.08 for e in errs), errs  # each of y, dx, dW quantised, none lost


@pytest.mark.fast
def test_fp8_linears_swaps_the_blocks_matmuls_only():
    torch.manual_seed(0)
    model = build_model("tiny", "clm", vocab_size=64)
    weights = [m.weight for m in model.transformer.h.modules() if isinstance(m, Conv1D)]
    ids = torch.randint(0, 64, (2, 16))
    want = model(ids).logits.detach()
    fp8_linears(model, "block")
    swapped = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert len(swapped) == 4 * model.config.n_layer and [m.layer.weight for m in swapped] == weights
    assert not isinstance(model.lm_head, FP8Linear)
    assert 1e-4 < rel(model(ids).logits.detach(), want) < 0.1


@pytest.mark.fast
def test_fp8_linear_of_an_nn_linear_and_under_autocast():
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 48)  # weight stored 48 x 32: FP8Linear multiplies by its transpose
    x = torch.randn(4, 5, 32, requires_grad=True)
    y = FP8Linear(lin, "row")(x)
    want = lin(x.detach())
    assert y.shape == want.shape and 0.005 < rel(y.detach(), want.detach()) < 0.06
    y.sum().backward()
    assert x.grad.shape == x.shape and lin.weight.grad.shape == lin.weight.shape
    with torch.autocast("cpu", torch.bfloat16):  # the matmul stays fp32 inside autocast
        assert FP8Matmul.apply(torch.randn(8, 32), torch.randn(32, 16), "tensor", "e5m2").dtype == torch.float32


@pytest.mark.parametrize("world", [2, 4])
def test_float8_all_gather_equals_one_process_at_half_the_bytes(world, tmp_path):
    run_worker("fp8", "fp8_gather_worker", tmp_path, num_processes=world, timeout=240)
    r = json.loads((tmp_path / "fp8_gather.json").read_text())
    assert r["equal"] and r["matrices"] == 8
    assert r["fp8_bytes"]["all_gather_into_tensor"] == r["numbers"]  # one byte a number
    assert r["bf16_bytes"]["all_gather_into_tensor"] == 2 * r["numbers"]
    assert r["fp8_bytes"]["all_reduce"] == 4 * r["matrices"]  # one amax a matrix
