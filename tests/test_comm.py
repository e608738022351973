"""`distcourse.comm` on real gloo processes: every collective timed at every size with nccl-tests' bus-bandwidth
factors (the speeds themselves are measurements, not tested), and the byte counting."""
import pytest
import torch
import torch.distributed as dist

from distcourse.comm import TIMED, bus_factor, count_collectives, measure_collectives, ring_bytes_sent

pytestmark = pytest.mark.fast  # every test here is quick: in the fast tier


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == bus_factor("all_to_all", 4) == 0.75
    assert bus_factor("broadcast", 8) == bus_factor("send_recv", 8) == 1.0


def test_ring_bytes_sent():
    assert ring_bytes_sent({"all_reduce": 100}, 2) == 100      # 2(N-1)/N
    assert ring_bytes_sent({"all_gather_single": 100, "reduce_scatter_single": 100}, 4) == 150


def test_count_collectives_counts_payloads_and_restores(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        original = dist.all_reduce
        with count_collectives() as counts:
            dist.all_reduce(torch.zeros(10))                         # 40 bytes
            dist.all_gather_into_tensor(torch.zeros(6), torch.zeros(6))  # the output: 24 bytes
        assert counts == {"all_reduce": 40, "all_gather_into_tensor": 24}
        assert dist.all_reduce is original                           # put back on exit
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two():
    return measure_collectives(worlds=(2,), max_mib=1, repeats=2)[2]


def test_every_collective_at_every_size(two):
    sizes = sorted({r["bytes"] for r in two})
    assert sizes == [1024 * 4 ** k for k in range(6)]  # 1 KiB ... 1 MiB
    assert {(r["collective"], r["bytes"]) for r in two} == {(c, s) for c in TIMED for s in sizes}
    factor = {"all_reduce": 1.0, "broadcast": 1.0, "send_recv": 1.0,  # nccl-tests' factors at 2 ranks, by hand
              "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5}
    for r in two:
        assert r["algbw"] == pytest.approx(r["bytes"] / r["seconds"])
        assert r["busbw"] == pytest.approx(r["bytes"] / r["seconds"] * factor[r["collective"]])
