"Tensor parallelism on 2 and 4 real processes (gloo): equal to one process, collectives counted, clipping global."
import json
import re
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conftest import free_port, run_worker
from distcourse.gpt import GPTConfig
from distcourse.tensor_parallel import (assert_sharded, check_tp, clip_tp_grads, count_comm, gather_full_state,
                                        is_split, random_batches, rel_diff, step_and_count, tensor_parallel,
                                        tiny_gpt, tp_grad_norm, tp_worker)

EXACT = 1e-5     # logits (absolute) and gradients (relative) vs one process; measured ≤ 4e-7
NORM = 1e-6      # global gradient norm vs one process's clip_grad_norm_, same weights; measured 0
LOSS_TOL = 1e-4  # relative, 20 AdamW steps; measured ≤ 2e-7 unclipped, ≤ 1.5e-6 clipped
NORM_TOL = 1e-5  # the pre-clip norm of each of the first 10 clipped steps, relative; measured ≤ 1.5e-6
# (steps 1-3: 0). Later the two runs' weights drift apart by rounding (lr 1e-2; the norm jumps from 0.73
# to 1.16 at step 12) and their norms with them: ≤ 7.5e-5 over 20 steps at tp=2, held to LOSS_TOL.
DTENSOR = 1e-6   # DTensor vs the by-hand split; measured 0 (the same ops in the same order)


def launch_worker(tmp_path, n, **kw):
    "`tp_worker(tmp_path, **kw)` on `n` processes in a fresh interpreter; what rank 0 wrote."
    run_worker("tensor_parallel", "tp_worker", tmp_path, n, timeout=180, **kw)
    return json.loads((tmp_path / "tp.json").read_text())


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"tp{n}")
def res(request, tmp_path_factory):
    return launch_worker(tmp_path_factory.mktemp(f"tp{request.param}"), request.param)


def per_block(log, n_layer=2) -> dict:
    "{'collective direction': (calls per block, set of elements per call)} from a `count_comm` log."
    calls = Counter(f"{name} {d}" for name, d, _ in log)
    return {k: (c / n_layer, {e for name, d, e in log if f"{name} {d}" == k}) for k, c in calls.items()}


def worst(got, want): return max(abs(a - b) / b for a, b in zip(got, want))


# ------------------------------------------------------------------ bad inputs, before any process group
CFG = GPTConfig(vocab_size=64, n_positions=32, n_layer=2, n_head=4, n_embd=32)


@pytest.mark.fast
@pytest.mark.parametrize("config, tp, world, message", [
    (CFG, 3, None, "n_head=4 is not divisible by tp=3"),
    (GPTConfig(64, 32, 2, n_head=8, n_embd=3), 8, None, "hidden size 4*n_embd=12 is not divisible by tp=8"),
    (GPTConfig(64, 32, 2, n_head=4, n_embd=34), 4, None, "n_embd=34 is not divisible by tp=4"),
    (CFG, 2, 3, "tp=2 does not divide the world size 3"),
    (CFG, 0, None, "at least 1")])
def test_check_tp_refuses(config, tp, world, message):
    with pytest.raises(ValueError, match=re.escape(message)): check_tp(config, tp, world)


@pytest.mark.fast
def test_check_tp_names_the_fix():
    with pytest.raises(ValueError, match=re.escape("pick tp in [1, 2, 4]")): check_tp(CFG, 3)
    with pytest.raises(ValueError, match=re.escape("launch a multiple of 4 processes")): check_tp(CFG, 4, 6)
    check_tp(CFG, 4, 8)
    check_tp(GPTConfig(65, 32, 2, 4, 32), 2)  # the vocabulary is replicated: it need not divide


@pytest.mark.fast
def test_worker_refuses_before_process_group(tmp_path, monkeypatch):
    "A bad degree raises in the worker before it touches torch.distributed (no rendezvous is even set up)."
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="n_head=4 is not divisible by tp=3"): tp_worker(tmp_path)
    assert not dist.is_initialized()


# ------------------------------------------------------------------ one process as a group of one
@pytest.fixture
def group_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.fast
def test_assert_sharded_catches_a_whole_linear(group_of_one):
    model = tensor_parallel(tiny_gpt())
    assert_sharded(model, 1)
    with pytest.raises(AssertionError, match="block 0 attn.c_attn is a Linear"): assert_sharded(tiny_gpt(), 1)
    with pytest.raises(AssertionError, match=re.escape("block 0 attn.c_attn: (96, 32), want (48, 32)")):
        assert_sharded(model, 2)
    model.transformer.h[1].mlp.c_fc = nn.Linear(32, 128)
    with pytest.raises(AssertionError, match="block 1 mlp.c_fc is a Linear"): assert_sharded(model, 1)


@pytest.mark.fast
def test_group_of_one_is_the_model(group_of_one):
    ref = tiny_gpt()
    idx, targets = random_batches(ref.config)[0]
    want, _, _ = step_and_count(ref, idx, targets)
    model = tensor_parallel(ref)
    got, _, log = step_and_count(model, idx, targets)
    assert torch.allclose(got, want, atol=1e-6)
    want_grads = {k: p.grad for k, p in ref.named_parameters()}
    assert rel_diff(gather_full_state(model, grads=True), want_grads) < EXACT
    assert len(log) == 8  # 2 blocks x (2 forward + 2 backward), even when nothing crosses a wire
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert abs(clip_tp_grads(model, 0.5) - norm) <= NORM * norm and norm > 0.5
    assert rel_diff(gather_full_state(model, grads=True), want_grads) < EXACT  # both clipped alike
    assert tp_grad_norm(model) < 0.5 + 1e-5


@pytest.mark.fast
def test_count_comm_has_no_global_state(group_of_one):
    "A log belongs to the model it was opened on, and only inside its block."
    a, b = tensor_parallel(tiny_gpt()), tensor_parallel(tiny_gpt())
    idx, targets = random_batches(a.config)[0]
    with count_comm(a) as log_a:
        b(idx, targets)  # another model: not logged here
        assert log_a == []
        a(idx, targets)
    assert len(log_a) == 4  # 2 blocks x 2 forward all-reduces
    a(idx, targets)  # outside the block: nothing logged
    assert len(log_a) == 4 and all(m.comm_log is None for m in a.modules() if hasattr(m, "comm_log"))


@pytest.mark.fast
def test_is_split(group_of_one):
    model = tensor_parallel(tiny_gpt())
    split = {k for k, _ in model.named_parameters() if is_split(model, k)}
    assert split == {f"transformer.h.{i}.{n}" for i in range(2) for n in (
        "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_fc.bias",
        "mlp.c_proj.weight")}  # the row-parallel biases, LayerNorms and embeddings are whole


# ------------------------------------------------------------------ 2 and 4 real processes
def test_equal_to_one_process(res):
    assert res["logits"] <= EXACT and res["grads"] <= EXACT, res
    assert res["weights"] == 0  # sliced from the full weights, gathered back exactly


def test_two_all_reduces_each_way_per_block(res):
    assert per_block(res["log"]) == {"all_reduce forward": (2, {res["bsh"]}),
                                     "all_reduce backward": (2, {res["bsh"]})}


def test_a_rank_holds_its_share(res):
    whole = 64 * 32 + 32 * 32 + 2 * 32 + 2 * (4 * 32 + 2 * 32)  # wte, wpe, ln_f; per block 2 LayerNorms, 2 biases
    assert res["local"] == (28_544 - whole) // res["tp"] + whole  # 9,776 at tp=4


def test_dtensor_matches_by_hand(res):
    d = res["dtensor"]
    assert d["logits"] <= DTENSOR and d["grads"] <= DTENSOR, d
    assert d["forward"] == d["backward"] == {"all_reduce": 2}  # per block, as CommDebugMode counts them


def test_twenty_steps(res):
    losses = res["losses"]
    ref = losses["one process"]
    assert len(ref) == 20 and ref[-1] < ref[0] - 0.3
    assert worst(losses["tp"], ref) <= LOSS_TOL
    assert worst(losses["tp, clipped"], losses["one process, clipped"]) <= LOSS_TOL
    assert worst(losses["one process, clipped"], ref) > 1e-3  # clipping changed the run


def test_clipping_uses_the_global_norm(res):
    norms = res["norms"]
    assert len(norms["tp"]) == len(norms["one process"]) == 20
    assert worst(norms["tp"][:1], norms["one process"]) <= NORM  # the same weights: the same norm
    first = worst(norms["tp"][:10], norms["one process"])  # zip: the first 10 steps
    all_steps = worst(norms["tp"], norms["one process"])
    print(f"tp={res['tp']}: worst relative pre-clip gradient norm {first:.1e} over 10 steps, "
          f"{all_steps:.1e} over 20 (step 1: {worst(norms['tp'][:1], norms['one process']):.1e})")
    assert first <= NORM_TOL and all_steps <= LOSS_TOL
    assert max(norms["one process"]) > 0.5  # clipping was active
