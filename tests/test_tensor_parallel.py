"Tensor and sequence parallelism on 2 and 4 real processes (gloo): equal to one process, collectives counted."
import json
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conftest import PY, free_port, run_cli
from distcourse.model import GPTConfig
from distcourse.tensor_parallel import (assert_sharded, check_tp, gather_full_state, per_block,
                                        random_batches, rel_diff, sp_saved_bytes, step_and_count,
                                        tensor_parallel, tiny_gpt, tp_worker)
from distcourse.zero import ring_bytes_sent

EXACT = 1e-5    # logits (absolute) and gradients (relative) vs one process; measured ≤ 4e-7
LOSS_TOL = 1e-4  # relative, 20 AdamW steps; measured ≤ 2e-7
DTENSOR = 1e-6   # DTensor vs the by-hand split; measured 0 (the same ops in the same order)


def launch_worker(tmp_path, n, **kw):
    "`tp_worker(tmp_path, **kw)` on `n` processes in a fresh interpreter; what rank 0 wrote."
    code = ("import json, sys; from functools import partial; from distcourse.launch import launch; "
            "from distcourse.tensor_parallel import tp_worker; "
            f"launch(partial(tp_worker, **json.loads(sys.argv[2])), (sys.argv[1],), num_processes={n})")
    proc = run_cli([PY, "-c", code, str(tmp_path), json.dumps(kw)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "tp.json").read_text())


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"tp{n}")
def res(request, tmp_path_factory):
    return launch_worker(tmp_path_factory.mktemp(f"tp{request.param}"), request.param)


@pytest.fixture(scope="module")
def dp_tp(tmp_path_factory):
    return launch_worker(tmp_path_factory.mktemp("dp_tp"), 4, tp=2)


# ------------------------------------------------------------------ bad inputs, before any process group
CFG = GPTConfig(vocab_size=64, n_positions=32, n_layer=2, n_head=4, n_embd=32)


@pytest.mark.parametrize("config, tp, world, message", [
    (CFG, 3, None, "n_head=4 is not divisible by tp=3"),
    (GPTConfig(64, 32, 2, n_head=8, n_embd=3), 8, None, "hidden size 4*n_embd=12 is not divisible by tp=8"),
    (GPTConfig(64, 32, 2, n_head=4, n_embd=34), 4, None, "n_embd=34 is not divisible by tp=4"),
    (CFG, 2, 3, "tp=2 does not divide the world size 3"),
    (CFG, 0, None, "at least 1")])
def test_check_tp_refuses(config, tp, world, message):
    with pytest.raises(ValueError, match=re.escape(message)): check_tp(config, tp, world)


def test_check_tp_names_the_fix():
    with pytest.raises(ValueError, match=re.escape("pick tp in [1, 2, 4]")): check_tp(CFG, 3)
    with pytest.raises(ValueError, match=re.escape("launch a multiple of 4 processes")): check_tp(CFG, 4, 6)
    check_tp(CFG, 4, 8)
    check_tp(GPTConfig(65, 32, 2, 4, 32), 2)  # the vocabulary is replicated: it need not divide


def test_worker_refuses_before_process_group(tmp_path, monkeypatch):
    "A bad degree raises in the worker before it touches torch.distributed (no rendezvous is even set up)."
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="n_head=4 is not divisible by tp=3"): tp_worker(tmp_path, tp=3)
    assert not dist.is_initialized()


# ------------------------------------------------------------------ one process as a group of one
@pytest.fixture
def group_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_assert_sharded_catches_a_whole_linear(group_of_one):
    model = tensor_parallel(tiny_gpt())
    assert_sharded(model, 1)
    with pytest.raises(AssertionError, match="block 0 attn.c_attn is a Linear"): assert_sharded(tiny_gpt(), 1)
    with pytest.raises(AssertionError, match=re.escape("block 0 attn.c_attn: (96, 32), want (48, 32)")):
        assert_sharded(model, 2)
    model.transformer.h[1].mlp.c_fc = nn.Linear(32, 128)
    with pytest.raises(AssertionError, match="block 1 mlp.c_fc is a Linear"): assert_sharded(model, 1)


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


# ------------------------------------------------------------------ 2 and 4 real processes
def test_equal_to_one_process(res):
    r = res["by_hand"]
    assert r["logits"] <= EXACT and r["grads"] <= EXACT, r
    assert r["weights"] == 0  # sliced from the full weights, gathered back exactly


def test_two_all_reduces_each_way_per_block(res):
    assert per_block(res["by_hand"]["log"], 2) == {"all_reduce forward": (2, res["bsh"]),
                                                   "all_reduce backward": (2, res["bsh"])}


def test_dtensor_matches_by_hand(res):
    d = res["dtensor"]
    assert d["logits"] <= DTENSOR and d["grads"] <= DTENSOR, d
    assert d["forward"] == d["backward"] == {"all_reduce": 2}  # per block, as CommDebugMode counts them
    assert {k: v[0] for k, v in d["by_hand"].items()} == {"all_reduce forward": 2, "all_reduce backward": 2}


def test_sequence_parallel(res):
    s, n, bsh = res["sp"], res["tp"], res["bsh"]
    assert s["logits"] <= EXACT and s["grads"] <= EXACT, s
    calls = {}
    for name, direction, elements in s["log"]:
        calls[(name, direction)] = calls.get((name, direction), 0) + 1
        if direction != "param_grad": assert elements == bsh
    assert calls == {("all_gather", "forward"): 5, ("reduce_scatter", "forward"): 4,  # 2 per block, + lm_head
                     ("all_gather", "backward"): 5, ("reduce_scatter", "backward"): 4,  # + the embedding
                     ("all_reduce", "param_grad"): 14}  # LayerNorms and row-parallel biases
    # Inside the blocks, all-gather + reduce-scatter send what all-reduce sent (2 more gathers: the ends).
    sp_bytes = {"all_gather": 4 * bsh * (10 - 2), "reduce_scatter": 4 * bsh * 8}
    tp_bytes = {"all_reduce": 4 * sum(e for _, _, e in res["by_hand"]["log"])}
    assert ring_bytes_sent(sp_bytes, n) == ring_bytes_sent(tp_bytes, n) > 0


def test_sequence_parallel_saves_the_predicted_memory(res):
    saved, n = res["sp"]["saved"], res["tp"]
    assert res["sp"]["predicted_saving"] == sp_saved_bytes(CFG, 4, 16, n) > 0
    assert saved["tp"] - saved["tp+sp"] == res["sp"]["predicted_saving"], saved
    assert saved["tp+sp"] < saved["tp"] < saved["one process"]


def test_twenty_steps(res):
    ref = res["losses"]["one process"]
    assert len(ref) == 20 and ref[-1] < ref[0] - 0.3
    for name in ("tp", "tp+sp"):
        worst = max(abs(a - b) / b for a, b in zip(res["losses"][name], ref))
        assert worst <= LOSS_TOL, (name, worst)


def test_data_times_tensor_parallel(dp_tp):
    r = dp_tp["dp_tp"]
    assert dp_tp["dp"] == 2 and dp_tp["tp"] == 2
    assert r["logits"] <= EXACT and r["grads"] <= EXACT, r
    half = dp_tp["bsh"] // 2  # each TP pair runs half of the batch
    assert per_block(r["log"], 2) == {"all_reduce forward": (2, half), "all_reduce backward": (2, half)}
    assert {d for _, d, _ in r["dp_log"]} == {"dp_grad"}
    assert sum(e for _, _, e in r["dp_log"]) == r["local_params"]  # each local gradient once, over dp
    losses = r["losses"]
    worst = max(abs(a - b) / b for a, b in zip(losses["dp x tp"], losses["one process"]))
    assert worst <= LOSS_TOL and len(losses["dp x tp"]) == 20, worst
