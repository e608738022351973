"""The collective matmul (async tensor parallelism) on 2 and 4 real processes (gloo): output and gradients equal to
all-gather + matmul (lesson 05d's `GatherLinear`), each against its own norm, and the tiny GPT under `async_tp` equal
to one process; planted faults refused by the same checks; the ring's point-to-point groups paired as NCCL requires."""
import json

import pytest

from conftest import run_worker
from distcourse.async_tp import ring_ops
from distcourse.comm import nccl_replay

EXACT = 1e-5  # relative, each tensor against its own norm (logits: absolute); measured ≤ 3.0e-7
KEYS = ["bias grad", "input grad", "output", "weight grad"]
MOVED = {"misplaced": ("output", "weight grad"),  # rows written one chunk off
         "skipped": ("output", "weight grad"),  # the last chunk never multiplied
         "unsummed": ("input grad",)}  # matmul + reduce-scatter: the running sum received, not added


def ring(tp, ops=ring_ops) -> dict:
    "Every rank's calls in `ring_gather` (one group per step, then its wait), for `nccl_replay`."
    return {r: [c for s in range(tp - 1) for c in (("post", s, ops(r, tp, (r - s) % tp)), ("wait", s))]
            for r in range(tp)}


@pytest.mark.fast
@pytest.mark.parametrize("tp", [2, 3, 4, 8])
def test_ring_is_paired_as_nccl_requires(tp):
    assert nccl_replay(ring(tp)) == {"mismatches": [], "stuck": []}


@pytest.mark.fast
def test_a_ring_sending_to_the_wrong_neighbour_is_caught():
    "The planted fault: each rank sends to rank-1, which expects nothing from it: the replay does not finish."
    def backwards(rank, tp, label):
        recv, _ = ring_ops(rank, tp, label)
        return [recv, ("send", (rank - 1) % tp, label)]
    assert nccl_replay(ring(4, backwards))["stuck"]


def equal(d): return all(v < EXACT for v in d.values())


# tp 2 in the fast tier (one launch, ~6 s: as written and every planted fault); tp 4 in the full tier
@pytest.mark.parametrize("tp", [pytest.param(2, marks=pytest.mark.fast), 4])
def test_collective_matmul_equals_all_gather_then_matmul_and_faults_are_refused(tmp_path, tp):
    run_worker("async_tp", "async_tp_worker", tmp_path, tp, timeout=120)
    res = json.loads((tmp_path / "async_tp.json").read_text())
    layer, gpt = res["layer"], res["gpt"]
    assert sorted(layer) == sorted(gpt) == sorted(["as written", *MOVED])
    assert sorted(layer["as written"]) == KEYS and sorted(gpt["as written"]) == ["grads", "logits"]
    assert equal(layer["as written"]), layer["as written"]
    assert equal(gpt["as written"]), gpt["as written"]  # the tiny GPT under async_tp against one process
    for fault, what in MOVED.items():  # the same checks fail on each fault, where it should show
        assert not equal(layer[fault]) and all(layer[fault][k] > 0.1 for k in what), (fault, layer[fault])
        assert gpt[fault]["grads"] > 0.1, (fault, gpt[fault])
