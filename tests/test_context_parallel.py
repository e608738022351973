"Context parallelism on real processes (gloo): ring attention and a GPT on a ring against one process; bad inputs."
import json

import pytest
import torch

from conftest import grads_diff, run_worker, worst_rel
from distcourse.context_parallel import (block_work, check_cp, cp_train_worker, reference_losses, ring_check_worker,
                                         zigzag_positions, zigzag_split, zigzag_unsplit)
from distcourse.gpt import GPTConfig

ATTN_TOL = 1e-5   # fp32 output and dQ/dK/dV vs SDPA on the whole sequence; measured ≤ 1e-6
LOSS_TOL = 1e-4   # relative, per step, vs one process; measured ≤ 3e-7
NORM_TOL = 1e-5   # the gradient norm per step (after the all-reduce), relative; measured ≤ 6e-7
GRAD_TOL = 1e-5   # step 1's gradients, each parameter's ‖Δg‖ / ‖g‖ of the whole; measured ≤ 1.5e-7
TINY = dict(vocab_size=64, n_positions=32, n_layer=2, n_head=4, n_embd=32)


def launch_worker(tmp_path, worker, n, **kw):
    "Run `distcourse.context_parallel.<worker>(tmp_path, **kw)` on `n` processes in a fresh interpreter."
    run_worker("context_parallel", worker, tmp_path, n, timeout=120, **kw)
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]


# ------------------------------------------------------------------ layout (no processes)
@pytest.mark.fast
def test_zigzag_layout():
    test_cases = [(16, 2), (32, 4), (64, 8)]
    for T, cp in test_cases:
        pos = [zigzag_positions(T, r, cp) for r in range(cp)]
        assert sorted(torch.cat(pos).tolist()) == list(range(T))  # every token held once
        c = T // (2 * cp)
        for r in range(cp):  # chunks r and 2cp-1-r
            assert pos[r].tolist() == list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
        x = torch.randn(3, T, 5)
        assert torch.equal(zigzag_unsplit([zigzag_split(x, r, cp) for r in range(cp)]), x)
        zz, naive = block_work(cp), block_work(cp, "contiguous")
        assert zz == [2 * cp + 1] * cp and max(zz) / min(zz) == 1.0
        assert naive == list(range(1, cp + 1)) and max(naive) / min(naive) == cp


@pytest.mark.fast
@pytest.mark.parametrize("args, message", [((36, 4, 4), "seq_len=36 is not divisible by 2 x cp = 8"),
                                           ((6, 4, 4), "multiple of 8, e.g. 8"),
                                           ((64, 3, 4), "cp=3 does not divide the world size 4"),
                                           ((64, 0, 4), "at least 1")])
def test_check_cp(args, message):
    with pytest.raises(ValueError, match=message): check_cp(*args)


@pytest.mark.fast
def test_workers_refuse_before_the_process_group(tmp_path, monkeypatch):
    "Bad degrees raise in the worker itself, before init_process_group (which would wait for peers)."
    import torch.distributed as dist
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="cp=3 does not divide the world size 4"):
        cp_train_worker(tmp_path, TINY, cp=3)
    with pytest.raises(ValueError, match="seq_len=30 is not divisible by 2 x cp = 8"):
        ring_check_worker(tmp_path, T=30)
    assert not dist.is_initialized()


# ------------------------------------------------------------------ ring attention on 2 and 4 processes
@pytest.mark.parametrize("p", [2, 4])
def test_ring_attention_equals_one_process(tmp_path, p):
    (res,) = launch_worker(tmp_path, "ring_check_worker", p)
    assert len(res) == p
    for r in res:
        assert max(r["errors"].values()) <= ATTN_TOL, r["errors"]
        assert r["forward"]["kv_sends"] == p - 1            # one K/V block per ring step after the first
        assert r["forward"].get("grad_sends", 0) == 0      # forward sends no gradients
        assert r["total"]["grad_sends"] == p - 1            # backward sends each block's gradient back
        assert r["forward"]["kv_sends_bytes"] == (p - 1) * 2 * 2 * 4 * (32 // p) * 8 * 4  # (2, B, nh, T/p, hs) fp32
    assert [r["forward"]["blocks"] for r in res] == block_work(p) == [2 * p + 1] * p


def test_contiguous_layout_is_correct_but_unbalanced(tmp_path):
    (res,) = launch_worker(tmp_path, "ring_check_worker", 4, layout="contiguous")
    assert max(max(r["errors"].values()) for r in res) <= ATTN_TOL
    assert [r["forward"]["blocks"] for r in res] == [1, 2, 3, 4]  # measured p : 1


# ------------------------------------------------------------------ a GPT trained on a ring
@pytest.fixture(scope="module")
def reference():
    "One process's losses, gradient norms per step and step 1's gradients."
    record = {}
    return reference_losses(GPTConfig(**TINY), steps=10, record=record), record


@pytest.mark.parametrize("cp, world", [(2, 2), (4, 4), (2, 4)])
def test_gpt_training_equals_one_process(tmp_path, reference, cp, world):
    "10 AdamW steps, loss over the global token count, gradients summed over all ranks (cp x dp)."
    (res,) = launch_worker(tmp_path, "cp_train_worker", world, cfg=TINY, cp=cp, steps=10)
    losses, record = reference
    assert len(res["losses"]) == 10
    worst = worst_rel(losses, res["losses"])
    assert worst <= LOSS_TOL, (worst, res["losses"], losses)
    assert losses[-1] < losses[0] - 0.2  # it trains
    # AdamW's update ignores a constant factor on every gradient: only the gradients show one.
    norms = worst_rel(record["grad_norms"], res["grad_norms"])
    grads = grads_diff(record["grads"], tmp_path / f"grads_cp{cp}.pt")
    print(f"cp={cp} on {world}: worst relative loss {worst:.1e}, gradient norm {norms:.1e}, "
          f"step-1 gradient {grads:.1e}")
    assert norms <= NORM_TOL and grads <= GRAD_TOL, (norms, grads)
    assert res["stats"]["kv_sends"] == TINY["n_layer"] * (cp - 1)  # one forward: p - 1 per layer
