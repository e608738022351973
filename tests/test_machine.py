"""The machine profile (lesson 09b): collectives timed by group size in real process groups, a call priced from
the table of the run's process count and its group size, and a bad profile name refused with what to pass."""
import json
from dataclasses import asdict, replace

import pytest

from distcourse.machine import PROFILES, TIMED_GROUPS, collective_s, load_profile, measure_groups

pytestmark = pytest.mark.fast  # every test here is quick: in the fast tier


@pytest.fixture(scope="module")
def groups():
    return measure_groups(worlds=(4,), sizes=(1024, 65536), ops=2, repeats=1)["4"]  # 4 real processes, gloo


def test_every_collective_by_every_group_size(groups):
    got = {(r["collective"], r["group"], r["bytes"]) for r in groups}
    assert got == {(c, n, b) for c in TIMED_GROUPS for n in (2, 4) for b in (1024, 65536)}
    assert all(r["seconds"] > 0 for r in groups)


def test_a_call_is_priced_from_its_world_and_group():
    row = lambda c, n, b, s: {"collective": c, "group": n, "bytes": b, "seconds": s}
    p = replace(load_profile("measured"), comm={
        "2": [row("all_reduce", 2, 1024, 1e-4), row("all_reduce", 2, 4096, 4e-4)],
        "4": [row("all_reduce", 2, 1024, 2e-3), row("all_reduce", 2, 4096, 8e-3),
              row("all_reduce", 4, 1024, 5e-3), row("all_reduce", 4, 4096, 2e-2)]})
    assert collective_s(p, "all_reduce", 1024, 2, world=2) == pytest.approx(1e-4)
    assert collective_s(p, "all_reduce", 1024, 2, world=4) == pytest.approx(2e-3)  # 2 of 4 processes: slower
    assert collective_s(p, "all_reduce", 1024, 4, world=4) == pytest.approx(5e-3)
    assert collective_s(p, "all_reduce", 2048, 4, world=4) == pytest.approx(1e-2)  # log-log between the rows
    assert collective_s(p, "all_reduce", 2048, 1, world=4) == 0.0
    h100 = PROFILES["h100-node"]  # latency + bus bytes / bandwidth: 2(n-1) hops of a ring all-reduce
    assert collective_s(h100, "all_reduce", 2**30, 8) == pytest.approx(14 * 5e-6 + 2 * 7 / 8 * 2**30 / 450e9)
    assert collective_s(h100, "all_reduce", 2**30, 16, across=True) > collective_s(h100, "all_reduce", 2**30, 16)


def test_profiles_load_by_name_or_file_and_refuse_the_rest(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(asdict(PROFILES["a100-node"]) | {"name": "mine"}))
    assert load_profile(str(path)).name == "mine" and load_profile(str(path)).flops == 312e12
    with pytest.raises(ValueError, match="h100-node, a100-node, measured, nor a JSON file"):
        load_profile("h200-node")
    p = load_profile("measured")
    assert p.shared and p.cores >= 1 and p.adamw_s > 0 and set(p.comm) == {"2", "4"}
