"""Activation recomputation in one process: the block's saved bytes predicted to the byte, checkpoint_blocks
on the course's GPT and transformers' GPT-2 (same loss and gradients, fewer bytes), the errors it raises."""
from contextlib import nullcontext

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import GPT2Config, GPT2LMHeadModel

from distcourse.gpt import GPT, GPTConfig, _Block
from distcourse.recompute import (activation_bytes, activation_terms, checkpoint_blocks, is_checkpointed,
                                  korthikanti_bytes, measure_saved_bytes, predicted_activation_bytes,
                                  recompute, saved_tensors)

pytestmark = pytest.mark.fast  # every test here is quick: in the fast tier

GRAD_TOL = 1e-6  # |Δgrad| with vs without recomputation; measured 0.0 (the same ops on the same inputs)


def cfg(h=64, a=4, layers=1, dropout=0.0, positions=128, vocab=64):
    return GPTConfig(vocab_size=vocab, n_positions=positions, n_layer=layers, n_head=a, n_embd=h,
                     dropout=dropout)


def block_storages(c, b, s, backend=None):
    "Bytes of each storage one training block keeps, in the order autograd saves them."
    torch.manual_seed(0)
    block = GPT(c).transformer.h[0].train()
    x = torch.randn(b, s, c.n_embd, requires_grad=True)  # (B, T, C)
    with sdpa_kernel(backend) if backend else nullcontext():  # None: what SDPA picks by itself
        return [t["bytes"] for t in saved_tensors(lambda: block(x), skip=list(block.parameters()))]


def grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def max_diff(g0, g1):
    assert g0.keys() == g1.keys()
    return max((g0[n] - g1[n]).abs().max().item() for n in g0)


def lm_batch(vocab=128, b=4, s=64, seed=0):
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


# ------------------------------------------------------------------ the count, by hand
def test_paper_formula():
    assert korthikanti_bytes(2048, 1, 12288, 96) == 2048 * 12288 * (34 + 80)  # GPT-3: 5as/h = 80
    for s, b, h, a in [(2048, 8, 12288, 96), (512, 8, 1024, 16), (64, 2, 64, 4)]:
        ours = predicted_activation_bytes(cfg(h, a, dropout=0.1, positions=s), b, s, dtype_bytes=2,
                                          attention="math", mask_bytes=1)
        assert ours - 16 * s * b == korthikanti_bytes(s, b, h, a)  # + the LayerNorm statistics only


def test_terms_by_hand():
    "The default path of the course (fp32, no dropout, fused attention): 64·sbh + 4·asb + 16·sb bytes."
    for s, b, h, a in [(32, 2, 64, 4), (128, 1, 64, 8), (16, 3, 48, 6)]:
        assert predicted_activation_bytes(cfg(h, a), b, s) == 64 * s * b * h + 4 * a * s * b + 16 * s * b
        assert predicted_activation_bytes(cfg(h, a), b, s, attention="math") == \
            64 * s * b * h + 4 * a * s * s * b + 16 * s * b + (8 * s * b * h if b == 1 else 0)  # b=1: v view


@pytest.mark.parametrize("kw, message", [(dict(c=cfg(64, 3), b=2, s=16), "not divisible by n_head=3"),
                                         (dict(c=cfg(positions=64), b=2, s=128), "exceeds the model's 64"),
                                         (dict(c=cfg(), b=2, s=16, attention="naive"), "choose 'flash'")])
def test_terms_refuse(kw, message):
    with pytest.raises(ValueError, match=message):
        activation_terms(kw.pop("c"), kw.pop("b"), kw.pop("s"), **kw)


# ------------------------------------------------------------------ measured against predicted
def test_counts_each_storage_once():
    x = torch.randn(1000, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(1000))
    assert measure_saved_bytes(lambda: x[:500] * x[500:]) == 4000  # two views, one storage
    assert measure_saved_bytes(lambda: x.sin().exp()) == 8000
    assert measure_saved_bytes(lambda: x * w) == 8000
    assert measure_saved_bytes(lambda: x * w, skip=[w]) == 4000
    with torch.no_grad(): assert measure_saved_bytes(lambda: x.sin()) == 0


@pytest.mark.parametrize("s, b, h, a", [(16, 2, 32, 4), (64, 1, 64, 8), (64, 4, 32, 2), (128, 2, 64, 4)])
@pytest.mark.parametrize("path", ["flash", "math", "dropout"])
def test_block_prediction_exact(s, b, h, a, path):
    "Storage by storage, in order, to the byte."
    c = cfg(h, a, dropout=0.1 if path == "dropout" else 0.0)
    got = block_storages(c, b, s, SDPBackend.MATH if path == "math" else None)
    want = activation_terms(c, b, s, attention="flash" if path == "flash" else "math")
    assert got == list(want.values()), (got, want)


def head_bytes(b, s, h, vocab):
    "What GPT keeps outside its blocks (fp32): ids, positions, ln_f, lm_head's input, log-probs, targets."
    return 8 * b * s + 8 * s + (4 * s * b * h + 8 * s * b) + 4 * s * b * h + 4 * s * b * vocab + 8 * b * s + 4


def test_activation_bytes_whole_gpt():
    c, (b, s) = cfg(64, 4, layers=4, positions=64, vocab=128), (4, 64)
    model, batch = GPT(c).train(), lm_batch(128, b, s)
    block = predicted_activation_bytes(c, b, s)
    assert activation_bytes(model, batch) == 4 * block + head_bytes(b, s, 64, 128)
    checkpoint_blocks(model)
    inputs = 4 * 4 * s * b * 64  # what each of the 4 checkpointed blocks keeps: its input
    assert activation_bytes(model, batch) == inputs + head_bytes(b, s, 64, 128)


# ------------------------------------------------------------------ recomputation keeps the results
def test_recompute_by_hand():
    torch.manual_seed(0)
    block, x = GPT(cfg()).transformer.h[0], torch.randn(2, 32, 64, requires_grad=True)
    loss0, g0 = grads(block, lambda: block(x).square().sum())
    gx0 = x.grad.clone(); x.grad = None
    loss1, g1 = grads(block, lambda: recompute(block, x).square().sum())
    assert loss0 == loss1 and max_diff(g0, g1) <= GRAD_TOL
    assert torch.allclose(x.grad, gx0, atol=GRAD_TOL, rtol=0)
    assert measure_saved_bytes(lambda: recompute(block, x), list(block.parameters())) == 4 * 2 * 32 * 64


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_checkpoint_blocks_gpt(dropout):
    torch.manual_seed(0)
    model, batch = GPT(cfg(64, 4, layers=3, dropout=dropout, positions=64, vocab=128)).train(), lm_batch()
    keys = list(model.state_dict())
    def seeded():  # the same dropout masks in both runs' first forward
        torch.manual_seed(1)
        return model(batch["input_ids"][:, :-1], batch["labels"][:, 1:])[1]
    loss0, g0 = grads(model, seeded)
    bytes_off = activation_bytes(model, batch)
    assert checkpoint_blocks(model) is model and is_checkpointed(model)
    loss1, g1 = grads(model, seeded)
    assert loss0 == loss1 and max_diff(g0, g1) <= GRAD_TOL  # checkpoint replays the RNG: same masks
    assert activation_bytes(model, batch) < bytes_off / 4
    assert list(model.state_dict()) == keys and model.lm_head.weight is model.transformer.wte.weight
    checkpoint_blocks(model, enabled=False)
    assert not is_checkpointed(model) and all(type(b) is _Block for b in model.transformer.h)
    assert activation_bytes(model, batch) == bytes_off


def test_checkpoint_blocks_transformers():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=3, n_head=4,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                       eos_token_id=None, attn_implementation="sdpa")).train()
    batch = lm_batch()
    loss_fn = lambda: model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
    loss0, g0 = grads(model, loss_fn)
    bytes_off = activation_bytes(model, batch)
    checkpoint_blocks(model)
    assert is_checkpointed(model)
    loss1, g1 = grads(model, loss_fn)
    assert loss0 == loss1 and max_diff(g0, g1) <= GRAD_TOL
    assert activation_bytes(model, batch) < bytes_off / 4
    checkpoint_blocks(model, enabled=False)
    assert not is_checkpointed(model) and activation_bytes(model, batch) == bytes_off


def test_checkpoint_blocks_refuses():
    with pytest.raises(ValueError, match="takes the course's GPT"): checkpoint_blocks(torch.nn.Linear(2, 2))
    model = GPT(cfg(layers=2))
    model.transformer.h[1].__class__ = type("Wrapped_Block", (_Block,), {})  # as fully_shard would leave it
    with pytest.raises(ValueError, match="already wrapped: call checkpoint_blocks before fully_shard"):
        checkpoint_blocks(model)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=4,
                                    bos_token_id=None, eos_token_id=None))
    hf.supports_gradient_checkpointing = False
    with pytest.raises(ValueError, match="does not support activation checkpointing"): checkpoint_blocks(hf)
