"Ulysses context parallelism on real processes (gloo): equal to one process, its bytes, its refusals, its exercises."
import json

import pytest
import torch
from fastcore import test as fc

from conftest import ROOT, run_worker
from distcourse.ulysses import check_ulysses, ring_bytes, ulysses_bytes, ulysses_check_worker

ATTN_TOL = 1e-5  # fp32 output and dQ/dK/dV vs SDPA on the whole sequence; measured 0 (Ulysses), ≤ 2e-6 (others)
B, NH, T, HS, NKV = 2, 8, 32, 8, 4  # ulysses_check_worker's defaults


def test_equal_to_one_process_and_bytes(tmp_path):
    "One launch of 4: cp=4, and cp=2 on two groups; each method against SDPA on the whole sequence; bytes per rank."
    run_worker("ulysses", "ulysses_check_worker", tmp_path, 4, timeout=120, cps=[2, 4])
    res = json.loads((tmp_path / "ulysses_4.json").read_text())
    assert len(res) == 4
    for p in (2, 4):
        for r in res:
            for name in ("ulysses", "ulysses_gqa", "allgather", "ring"):
                m = r[f"{name}_{p}"]
                assert max(m["errors"].values()) <= ATTN_TOL, (name, p, m["errors"])
            assert r[f"ulysses_{p}"]["forward"] == {"a2a": 4, "a2a_bytes": ulysses_bytes(B, NH, T, HS, p)}
            assert r[f"ulysses_{p}"]["total"]["grad_a2a"] == 4  # backward: the reverse of each
            assert r[f"ulysses_{p}"]["total"]["grad_a2a_bytes"] == ulysses_bytes(B, NH, T, HS, p)
            assert r[f"ulysses_gqa_{p}"]["forward"]["a2a_bytes"] == ulysses_bytes(B, NH, T, HS, p, n_kv_head=NKV)
            assert r[f"ring_{p}"]["forward"]["kv_sends_bytes"] == ring_bytes(B, NH, T, HS, p)
            assert r[f"allgather_{p}"]["forward"]["gather_bytes"] == (p - 1) * 2 * B * NKV * (T // p) * HS * 4
        # the formulas by hand: 4 tensors of B·nh·(T/p)·hs fp32, (p-1)/p of each leaves the rank
        assert ulysses_bytes(B, NH, T, HS, p) == 4 * B * NH * (T // p) * HS * 4 * (p - 1) // p
        assert ring_bytes(B, NH, T, HS, p) / ulysses_bytes(B, NH, T, HS, p) == p / 2


@pytest.mark.fast
@pytest.mark.parametrize("args, message", [((6, 4), "n_head=6 does not split into cp=4"),
                                           ((6, 4), "choose a cp that divides n_head (1, 2, 3, 6), or use ring"),
                                           ((32, 16, 8), "n_kv_head=8 does not split into cp=16"),
                                           ((8, 0), "at least 1")])
def test_check_ulysses_refuses(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")): check_ulysses(*args)


@pytest.mark.fast
def test_worker_refuses_before_the_process_group(tmp_path, monkeypatch):
    "cp=3 with 8 heads raises in the worker, before init_process_group (which would wait for peers)."
    import torch.distributed as dist
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="n_head=8 does not split into cp=3"): ulysses_check_worker(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="n_head=6 does not split into cp=4"): ulysses_check_worker(tmp_path, n_head=6)
    assert not dist.is_initialized()


@pytest.mark.fast
def test_exercise_checks_refuse_wrong_answers():
    "The lesson's exercise checks, run from the notebook: right answers pass, plausible wrong ones fail."
    nb = json.loads((ROOT / "nbs" / "05i_ulysses.ipynb").read_text())
    cell = next("".join(c["source"]) for c in nb["cells"] if "def check_max_cp" in "".join(c["source"]))
    scope = {"test_eq": fc.test_eq, "check_ulysses": check_ulysses, "ring_bytes": ring_bytes,
             "ulysses_bytes": ulysses_bytes, "torch": torch}
    exec(cell, scope)
    scope["check_max_cp"](8)
    fc.test_fail(lambda: scope["check_max_cp"](32), contains="==")  # the query heads only
    scope["check_a2a_bytes"](ulysses_bytes(1, 32, 131072, 128, 8, itemsize=2, backward=True) * 32)
    fc.test_fail(lambda: scope["check_a2a_bytes"](32 * 2 * 4 * 32 * (131072 // 8) * 128 * 2), contains="==")
    fc.test_fail(lambda: scope["check_a2a_bytes"](32 * 4 * 7 * 32 * (131072 // 8) * 128 * 2 // 8), contains="==")
    scope["check_ratio"](8.0)
    fc.test_fail(lambda: scope["check_ratio"](1.0), contains="==")
