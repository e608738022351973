"""The GPU model's parts (lesson 09bb) and how the planner (09c) uses them: PyTorch's schedules replayed from its own
order, matmuls by shape, stages balanced, selective recomputation, links per node, data-parallel overlap by
schedule; the held-out validation file and the GPU script that waits for a GPU."""
import json
import subprocess
import sys
from dataclasses import replace
from itertools import product

import pytest

import distcourse.planner as plan
from conftest import ROOT
from distcourse.gpu_costs import (matmul_s, replay_order, schedule_costs, selective_terms, stage_layers,
                                  torch_order)
from distcourse.machine import PROFILES, collective_s, load_profile
from distcourse.pipeline import bubble_fraction
from distcourse.schedules import actions, in_flight, replay_actions
from distcourse.sizes import Shape, shape_of

pytestmark = pytest.mark.fast  # every test here is quick: in the fast tier

H100, A100 = PROFILES["h100-node"], PROFILES["a100-node"]
LLAMA = Shape("llama3-405b", 126, 16384, 128, 128000, n_positions=0, d_ff=53248, n_kv_head=8, megatron=True)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_pytorchs_interleaved_order_idles_and_holds_as_05fs(pp, m):
    idle, held = replay_order(torch_order("interleaved", pp, m), pp)
    assert idle == pytest.approx(bubble_fraction(replay_actions("interleaved", pp, m), pp), abs=1e-12)
    assert held == [in_flight(actions("interleaved", r, pp, m), False) / 2 for r in range(pp)]


@pytest.mark.parametrize("name", ["zb", "zbv", "dualpipev"])
def test_schedule_costs_scales_a_short_replay_exactly(name):
    for pp, m in [(2, 12), (4, 40), (8, 48)]:
        full, held = replay_order(torch_order(name, pp, m), pp)
        fast, fast_held = schedule_costs(name, pp, m)
        assert fast == pytest.approx(full, abs=1e-12) and list(fast_held) == held


def test_zero_bubble_schedules_are_priced_on_their_own():
    zbh1 = bubble_fraction(replay_actions("zb-h1", 4, 8), 4)
    assert schedule_costs("zbv", 4, 8)[0] < zbh1 < schedule_costs("1f1b", 4, 8)[0]  # ZBV's V beats ZB-H1
    assert plan.bubble("zbv", 4, 8) == schedule_costs("zbv", 4, 8)[0] != plan.bubble("dualpipev", 4, 8)


def test_a_matmul_by_its_shape():
    share = [2 * m * 4096**2 / matmul_s(H100, m, 4096, 4096) / H100.flops for m in (8, 64, 256, 4096)]
    assert share == sorted(share) and share[0] < 0.05 and share[-1] == pytest.approx(H100.mm_frac)
    # b1 x 8 and b8 x 1 no longer tie: 8 micro-batches of 1 sequence against 1 of 8, seq 128
    small = shape_of("small", n_layer=4)
    one, eight = (plan.step_time(small, plan.Layout(1, batch_size=b, grad_accum=8 // b), 128, H100)
                  for b in (1, 8))
    assert sum(one.values()) > 1.2 * sum(eight.values())


def test_stages_balanced_around_the_output_layer():
    assert stage_layers(126, 16, 0.65) == [7] + [8] * 14 + [7]  # Llama 3's split
    for n_layer, pp, head in product((2, 7, 12), (2, 3, 4), (0.0, 0.5, 1.7, 3.0, 40.0)):
        got = stage_layers(n_layer, pp, head)
        load = max(got[:-1] + [got[-1] + head])
        best = min(max(list(c[:-1]) + [c[-1] + head]) for c in product(range(n_layer + 1), repeat=pp)
                   if sum(c) == n_layer)  # every split, by brute force
        assert sum(got) == n_layer and load == pytest.approx(best)


def test_selective_recomputation_sits_between_none_and_full():
    L = plan.Layout(64, 1, 8, 16, "interleaved", 32, batch_size=1)
    none, sel, full = (plan.memory(LLAMA, replace(L, activation_checkpointing=a), 8192, "bf16")["activations"]
                       for a in (False, "selective", True))
    assert full < sel < none
    t = [sum(plan.step_time(LLAMA, replace(L, activation_checkpointing=a), 8192, H100).values())
         for a in (False, "selective", True)]
    assert t[0] < t[1] < t[2]
    assert str(replace(L, activation_checkpointing="selective")).endswith(" sac b1x32")
    assert selective_terms({"SwiGLU": 8.0, "ln_1 output (matmul input)": 2.0, "q": 1.0}, LLAMA) == {"SwiGLU": 4.0,
                                                                                                   "q": 1.0}


def test_a_group_across_nodes_crosses_on_its_members_nics():
    one = collective_s(H100, "all_reduce", 2**30, 16, True)
    eight = collective_s(H100, "all_reduce", 2**30, 16, True, per_node=8)
    assert one / eight == pytest.approx(8, rel=0.05)  # 8 NICs a node: 8 x 50 GB/s, under NVLink's 450
    assert collective_s(H100, "all_reduce", 2**30, 16, True, per_node=16) == pytest.approx(
        30 * 10e-6 + 2 * 15 / 16 * 2**30 / 450e9)  # never faster than NVLink


def test_ddp_hides_its_reduction_behind_the_last_micro_batch_only():
    s = Shape("gpt-40x6144", 40, 6144, 48, 51200, 2048, megatron=True)  # Megatron's 18.4 B, TP 8, DP 32
    t = plan.step_time(s, plan.Layout(32, 0, 8, grad_accum=32), 2048, A100)
    assert 0 < t["dp"] < 2 / 3 * t["compute"]  # the whole step's backward would cover it; the last one's does not
    one = plan.step_time(s, plan.Layout(32, 0, 8, grad_accum=1, batch_size=32), 2048, A100)
    assert one["dp"] < t["dp"]  # one micro-batch of 32 sequences: the same reduction, 32 times the backward


def test_the_validation_file_is_what_its_script_computes(tmp_path):
    got = json.loads((ROOT / "benchmarks/plan_validation.json").read_text())
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import plan_validation
        for name, f in got["files"].items():
            measured = json.loads((ROOT / "benchmarks" / name).read_text())
            rows = plan_validation.rows_of(measured, load_profile("measured"))
            for w, s in f["worlds"].items():
                want = plan_validation.summary([r for r in rows if r["world"] == int(w)])
                assert set(want) == set(s)
                for k, v in want.items():
                    assert s[k] == (v if isinstance(v, (str, type(None))) else pytest.approx(v, rel=1e-9)), k
    finally: sys.path.remove(str(ROOT / "benchmarks"))
    assert {"development", "held out"} == {f["role"] for f in got["files"].values()}


def test_the_gpu_script_waits_for_a_gpu():
    status = json.loads((ROOT / "benchmarks/gpu_plan.json").read_text())
    assert status["status"] in ("not run", "run") and status["what"]
    r = subprocess.run([sys.executable, "benchmarks/gpu_plan.py", "--json", "/dev/null"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "needs a CUDA GPU" in r.stderr
