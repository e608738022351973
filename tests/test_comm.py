"""`benchmarks/bench_comm.py` on 2 real gloo processes: every collective at every size, nccl-tests' bus-bandwidth
factors (the speeds themselves are measurements, not tested)."""
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_comm import COLLECTIVES, bus_factor, measure  # noqa: E402


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == bus_factor("all_to_all", 4) == 0.75
    assert bus_factor("broadcast", 8) == bus_factor("send_recv", 8) == 1.0


@pytest.fixture(scope="module")
def two():
    return measure(worlds=(2,), max_mib=1, repeats=2)[2]


def test_every_collective_at_every_size(two):
    sizes = sorted({r["bytes"] for r in two})
    assert sizes == [1024 * 4 ** k for k in range(6)]  # 1 KiB ... 1 MiB
    assert {(r["collective"], r["bytes"]) for r in two} == {(c, s) for c in COLLECTIVES for s in sizes}
    for r in two:
        assert r["seconds"] > 0
        assert r["algbw"] == pytest.approx(r["bytes"] / r["seconds"])
        assert r["busbw"] == pytest.approx(r["algbw"] * bus_factor(r["collective"], 2))
