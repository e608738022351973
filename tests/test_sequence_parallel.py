"Sequence parallelism and dp x tp on 2 and 4 real processes (gloo): equal to one process, collectives and memory."
import json
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from conftest import free_port, run_worker
from distcourse.gpt import GPTConfig
from distcourse.sequence_parallel import layer_saved_bytes, sequence_parallel, sp_saved_bytes, sp_worker
from distcourse.tensor_parallel import (count_comm, gather_full_state, random_batches, rel_diff, step_and_count,
                                        tensor_parallel, tiny_gpt)
from distcourse.comm import ring_bytes_sent

EXACT = 1e-5    # logits (absolute) and gradients (relative) vs one process; measured ≤ 4e-7
LOSS_TOL = 1e-4  # relative, 20 AdamW steps; measured ≤ 2e-7
NORM_TOL = 1e-5  # the gradient norm of each of the 20 steps, relative; measured ≤ 5.7e-6 (step 1:
#                7e-8; the weights drift apart by rounding at lr 1e-2, the later norms with them)
CFG = GPTConfig(vocab_size=64, n_positions=32, n_layer=2, n_head=4, n_embd=32)
SP_CALLS = {("all_gather", "forward"): 5, ("reduce_scatter", "forward"): 4,  # 2 per block, + before lm_head
            ("all_gather", "backward"): 9, ("reduce_scatter", "backward"): 4,  # + after the embedding;
            # backward: 2 more all-gathers per block, the chunk each column layer kept gathered again
            ("all_reduce", "param_grad"): 14}  # LayerNorms and row-parallel biases


def launch_worker(tmp_path, n, **kw):
    "`sp_worker(tmp_path, **kw)` on `n` processes in a fresh interpreter; what rank 0 wrote."
    run_worker("sequence_parallel", "sp_worker", tmp_path, n, timeout=180, **kw)
    return json.loads((tmp_path / "sp.json").read_text())


# tp 2: sequence parallelism's smallest proof, in the fast tier; tp 4 in the full tier
@pytest.fixture(scope="module", params=[pytest.param(2, marks=pytest.mark.fast), 4], ids=lambda n: f"tp{n}")
def res(request, tmp_path_factory):
    return launch_worker(tmp_path_factory.mktemp(f"sp{request.param}"), request.param)


@pytest.fixture(scope="module")
def dp_tp(tmp_path_factory):
    return launch_worker(tmp_path_factory.mktemp("dp_tp"), 4, tp=2)


def worst(got, want): return max(abs(a - b) / b for a, b in zip(got, want))


# ------------------------------------------------------------------ before any process group; a group of one
@pytest.mark.fast
def test_worker_refuses_before_process_group(tmp_path, monkeypatch):
    "A bad degree raises in the worker before it touches torch.distributed (no rendezvous is even set up)."
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="n_head=4 is not divisible by tp=3"): sp_worker(tmp_path, tp=3)
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match="tp=4 does not divide the world size 6"): sp_worker(tmp_path, tp=4)
    assert not dist.is_initialized()


@pytest.fixture
def group_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.fast
def test_group_of_one_is_the_model(group_of_one):
    ref = tiny_gpt()
    idx, targets = random_batches(ref.config)[0]
    want, _, _ = step_and_count(ref, idx, targets)
    model = sequence_parallel(ref)
    got, _, log = step_and_count(model, idx, targets)
    assert torch.allclose(got, want, atol=1e-6)
    assert rel_diff(gather_full_state(model, grads=True), {k: p.grad for k, p in ref.named_parameters()}) < EXACT
    assert Counter((name, d) for name, d, _ in log) == SP_CALLS  # counted even when nothing crosses a wire
    assert model.state_dict().keys() == tensor_parallel(ref).state_dict().keys()  # the hooks add no state
    with count_comm(tensor_parallel(ref)) as other: model(idx, targets)
    assert other == []  # another model's log stays empty


# ------------------------------------------------------------------ 2 and 4 real processes
def test_equal_to_one_process(res):
    s = res["sp"]
    assert s["logits"] <= EXACT and s["grads"] <= EXACT, s


def test_collectives_and_bytes(res):
    s, n, bsh = res["sp"], res["tp"], res["bsh"]
    assert Counter((name, d) for name, d, _ in s["log"]) == SP_CALLS
    assert {e for _, d, e in s["log"] if d != "param_grad"} == {bsh}  # each of B·T·C elements
    assert Counter((name, d) for name, d, _ in s["tp_log"]) == {("all_reduce", "forward"): 4,
                                                               ("all_reduce", "backward"): 4}
    # Inside the blocks, all-gather + reduce-scatter send what all-reduce sent (2 more gathers: the ends);
    # keeping the chunk adds 2 all-gathers per block in backward: 5/4 of TP's bytes.
    whole = {"all_gather": 4 * bsh * (10 - 2), "reduce_scatter": 4 * bsh * 8}
    sp_bytes = {"all_gather": 4 * bsh * (14 - 2), "reduce_scatter": 4 * bsh * 8}
    tp_bytes = {"all_reduce": 4 * sum(e for _, _, e in s["tp_log"])}
    assert Counter((name, d) for name, d, _ in s["whole_log"]) == {**SP_CALLS, ("all_gather", "backward"): 5}
    assert ring_bytes_sent(whole, n) == ring_bytes_sent(tp_bytes, n) > 0
    assert ring_bytes_sent(sp_bytes, n) == 1.25 * ring_bytes_sent(tp_bytes, n)


def test_sequence_parallel_saves_the_predicted_memory(res):
    s, n = res["sp"], res["tp"]
    saved = s["saved"]
    assert s["predicted_saving"] == sp_saved_bytes(CFG, 4, 16, n) > 0
    gathered = saved["tp+sp, gathered kept"]  # the LayerNorms split, the column layers' inputs kept whole
    assert saved["tp"] - gathered == s["predicted_saving"], saved  # 21,760 B at tp=2, 32,640 at tp=4
    assert saved["tp+sp"] < gathered < saved["tp"] < saved["one process"]
    assert s["whole_grads"] <= EXACT


def test_saved_bytes_per_block_match_the_adjusted_formula(res):
    "Korthikanti et al.'s sbh(34/t + 5as/(ht)) for TP+SP (and the TP, one-process rows), adjusted to this GPT."
    per, n, tokens = res["sp"]["per_block"], res["tp"], 4 * 16
    h, a = CFG.n_embd, CFG.n_head
    assert per["tp+sp"] == layer_saved_bytes(tokens, h, a, n, sp=True) == tokens * 4 * (16 * h + a + 4) / n
    assert per["tp"] == layer_saved_bytes(tokens, h, a, n) == tokens * 4 * (4 * h + 4 + (12 * h + a) / n)
    assert per["one process"] == layer_saved_bytes(tokens, h, a) == n * per["tp+sp"]
    assert per["tp+sp, gathered kept"] == layer_saved_bytes(tokens, h, a, n, sp=True, keep_chunk=False)


def test_twenty_steps(res):
    ref = res["losses"]["one process"]
    assert len(ref) == 20 and ref[-1] < ref[0] - 0.3
    assert worst(res["losses"]["tp+sp"], ref) <= LOSS_TOL
    norms = res["norms"]  # AdamW ignores a constant factor on the gradients: their norm shows it
    assert len(norms["tp+sp"]) == len(norms["one process"]) == 20
    print(f"tp+sp: worst relative gradient norm {worst(norms['tp+sp'], norms['one process']):.1e}")
    assert worst(norms["tp+sp"], norms["one process"]) <= NORM_TOL


def test_data_times_tensor_parallel(dp_tp):
    r = dp_tp["dp_tp"]
    assert dp_tp["dp"] == 2 and dp_tp["tp"] == 2
    assert r["logits"] <= EXACT and r["grads"] <= EXACT, r
    half = dp_tp["bsh"] // 2  # each TP pair runs half of the batch
    assert Counter((name, d, e) for name, d, e in r["log"]) == {("all_reduce", "forward", half): 4,
                                                               ("all_reduce", "backward", half): 4}
    assert {d for _, d, _ in r["dp_log"]} == {"dp_grad"}
    assert sum(e for _, _, e in r["dp_log"]) == r["local_params"]  # each local gradient once, over dp
    losses = r["losses"]
    assert len(losses["dp x tp"]) == 20 and worst(losses["dp x tp"], losses["one process"]) <= LOSS_TOL
    norms = r["norms"]
    assert len(norms["dp x tp"]) == len(norms["one process"]) == 20
    dn = worst(norms["dp x tp"], norms["one process"])
    print(f"dp x tp: worst relative gradient norm {dn:.1e}")
    assert worst(norms["dp x tp"], norms["one process"]) <= NORM_TOL
