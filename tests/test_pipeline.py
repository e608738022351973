"Pipeline parallelism on 2 and 4 real processes (gloo): equal to one process, schedule order, bubble, errors."
import json
import re

import pytest
import torch
import torch.distributed as dist

from conftest import run_worker
from distcourse.gpt import GPT, GPTConfig
from distcourse.pipeline import (SCHEDULES, GPTStage, bubble_fraction, check_pp, peak_in_flight,
                                 pipeline_stage, pp_worker, replay, schedule_actions, split_micro_batches)

TOL = 1e-6  # fp32; measured ≤ 2.2e-8 against one process (sums in another order); PyTorch's vs ours: 0
REL_TOL = 1e-5  # each gradient tensor against its own norm, ‖g - g_ref‖ / ‖g_ref‖; measured ≤ 2.9e-7
NORM_TOL = 1e-5  # the whole gradient's norm (before any clipping), relative; measured ≤ 8.9e-8
TINY = dict(vocab_size=64, n_positions=32, n_layer=4, n_head=4, n_embd=32)


def launch_worker(tmp_path, num_processes, **kw):
    "`pp_worker(tmp_path, **kw)` on `num_processes` processes, a fresh interpreter and a timeout; its json."
    run_worker("pipeline", "pp_worker", tmp_path, num_processes, timeout=240, **kw)  # a hang fails, not stalls
    return json.loads((tmp_path / f"pp{kw['pp']}.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    "Both schedules, by hand and with torch.distributed.pipelining, m = 4 and 8, on 2 and on 4 stages."
    return {p: launch_worker(tmp_path_factory.mktemp(f"pp{p}"), p, pp=p, micro_batches=[4, 8])
            for p in (2, 4)}


def settings(res):
    for m in (4, 8):
        for api, per_schedule in res.get(str(m), {}).items():
            for schedule, out in per_schedule.items(): yield m, api, schedule, out


def assert_equal_to_one_process(pipe, ref_loss, where):
    "One pipeline's step against one process: its loss, each gradient tensor against its own norm, the tied copies."
    assert abs(pipe["loss"] - ref_loss) <= TOL, (where, pipe["loss"], ref_loss)
    assert pipe["missing"] == [], (where, pipe["missing"])  # every parameter of the model was compared
    assert pipe["grad_rel"] <= REL_TOL, (where, pipe["grad_rel"])  # the worst tensor's relative error
    assert pipe["grad_diff"] <= TOL, (where, pipe["grad_diff"])  # the worst element
    assert pipe["tied_diff"] == 0, (where, pipe["tied_diff"])  # wte (first stage) vs lm_head (last): one all-reduce
    assert pipe["norm_diff"] <= NORM_TOL, (where, pipe["norm_diff"])


def worst(outs, key): return max(pipe[key] for o in outs for pipe in o["pipelines"])


@pytest.mark.parametrize("p", [2, 4])
def test_equal_to_one_process(runs, p):
    seen = set()
    for m, api, schedule, out in settings(runs[p]):
        assert len(out["pipelines"]) == 1, (m, api, schedule)  # p processes, p stages: one pipeline
        assert_equal_to_one_process(out["pipelines"][0], runs[p]["ref_loss"], (m, api, schedule))
        seen.add((m, api, schedule))
    assert len(seen) == 8
    outs = [o for *_, o in settings(runs[p])]
    print(f"pp={p}: worst gradient tensor {worst(outs, 'grad_rel'):.1e} of its norm, "
          f"worst element {worst(outs, 'grad_diff'):.1e}, whole norm {worst(outs, 'norm_diff'):.1e}, "
          f"tied copies {worst(outs, 'tied_diff'):.1e}")


@pytest.mark.parametrize("p", [2, 4])
def test_torch_pipelining_equals_by_hand(runs, p):
    for m, api, schedule, out in settings(runs[p]):
        if api == "torch": assert out["vs_hand"] <= TOL, (m, schedule, out["vs_hand"])


@pytest.mark.parametrize("p", [2, 4])
def test_activations_in_flight(runs, p):
    "Counted during the step: GPipe holds m micro-batches on every stage, 1F1B p - stage."
    for m, api, schedule, out in settings(runs[p]):
        if api == "hand":
            assert out["peak"] == ([m] * p if schedule == "gpipe" else [p - s for s in range(p)])


@pytest.mark.parametrize("p", [2, 4])
def test_timeline(runs, p):
    "Each stage ran its schedule's order; across processes a forward starts after the one before it ended."
    for m, api, schedule, out in settings(runs[p]):
        if api != "hand": continue
        ev = out["timeline"]
        for s in range(p):
            mine = sorted((e for e in ev if e["stage"] == s), key=lambda e: e["start"])
            assert [(e["kind"], e["mb"]) for e in mine] == schedule_actions(schedule, s, p, m)
            assert all(a["end"] <= b["start"] for a, b in zip(mine, mine[1:]))  # one piece of work at a time
        at = {(e["stage"], e["kind"], e["mb"]): e for e in ev}
        for s in range(p - 1):
            for i in range(m):  # perf_counter is one clock for all processes of the machine
                assert at[(s, "F", i)]["end"] <= at[(s + 1, "F", i)]["start"]
                assert at[(s + 1, "B", i)]["end"] <= at[(s, "B", i)]["start"]
        print(f"p={p} m={m} {schedule}: bubble measured {out['bubble']:.3f}, "
              f"predicted {(p - 1) / (m + p - 1):.3f}")  # a timing: printed, not asserted (the machine is shared)


def test_two_pipelines(tmp_path):
    "4 processes, pp=2: two pipelines side by side (ranks 0, 2 and 1, 3), each equal to one process on its own."
    res = launch_worker(tmp_path, 4, pp=2, micro_batches=[4])
    assert res["world_size"] == 4
    seen = set()
    for m, api, schedule, out in settings(res):
        assert len(out["pipelines"]) == 2, (api, schedule)  # every pipeline reported, none written over
        for d, pipe in enumerate(out["pipelines"]):
            assert_equal_to_one_process(pipe, res["ref_loss"], (api, schedule, f"pipeline {d}"))
        if api == "torch": assert out["vs_hand"] <= TOL, (schedule, out["vs_hand"])
        seen.add((api, schedule))
    assert len(seen) == 4
    outs = [o for *_, o in settings(res)]
    print(f"dp=2 x pp=2: worst gradient tensor {worst(outs, 'grad_rel'):.1e} of its norm, "
          f"tied copies {worst(outs, 'tied_diff'):.1e}, losses {[p['loss'] for p in outs[0]['pipelines']]}")


@pytest.mark.fast
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 4), (8, 32), (3, 5)])
def test_replay_bubble(p, m):
    for schedule in SCHEDULES:
        for t_f, t_b in ((1.0, 2.0), (1.0, 1.0), (0.5, 3.0)):
            got = bubble_fraction(replay(schedule, p, m, t_f, t_b), p)
            assert got == pytest.approx((p - 1) / (m + p - 1))
    for s in range(p):
        assert peak_in_flight(schedule_actions("gpipe", s, p, m)) == m
        assert peak_in_flight(schedule_actions("1f1b", s, p, m)) == min(p - s, m)


@pytest.mark.fast
def test_stages_compose():
    "In one process the stages, called in turn, are the model; names are GPT-2's."
    torch.manual_seed(0)
    gpt, idx = GPT(GPTConfig(**TINY)), torch.randint(0, 64, (2, 8))
    stages = [pipeline_stage(gpt, r, 4) for r in range(4)]
    x = idx
    with torch.no_grad():
        for st in stages: x = st(x)
        assert torch.equal(x, gpt(idx)[0])
    assert [list(st.layers) for st in stages] == [[0], [1], [2], [3]]
    names = {n for st in stages for n, _ in st.named_parameters()}
    assert names == {*dict(gpt.named_parameters()), "lm_head.weight"}
    assert stages[-1].lm_head.weight is not stages[0].transformer.wte.weight  # a copy on another stage
    one = GPTStage(gpt, 0, 1)
    assert one.lm_head.weight is one.transformer.wte.weight  # one stage: tied as in GPT


@pytest.mark.fast
def test_stage_is_outermost():
    "Stages are the outermost axis: with 8 ranks and pp 2, ranks 0-3 run stage 0 and 4-7 stage 1."
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**TINY))
    assert [pipeline_stage(gpt, r, 2, 8).stage for r in range(8)] == [0] * 4 + [1] * 4
    assert [pipeline_stage(gpt, r, 4).stage for r in range(4)] == [0, 1, 2, 3]  # one pipeline


@pytest.mark.fast
@pytest.mark.parametrize("args, message", [
    ((4, 3), "n_layer=4 does not divide into pp=3"),
    ((2, 4), "n_layer=2 is fewer than pp=4"),
    ((4, 4, 2, "1f1b"), "micro_batches=2 < pp=4"),
    ((4, 2, 3, "gpipe", None, 8), "batch_size=8 does not divide into micro_batches=3"),
    ((4, 2, 4, "1f1b", 3), "pp=2 does not divide the world size 3"),
    ((4, 2, 4, "interleaved"), "choose 'gpipe' or '1f1b'"),
])
def test_check_pp(args, message):
    with pytest.raises(ValueError, match=re.escape(message)): check_pp(*args)


@pytest.mark.fast
def test_check_pp_accepts():
    check_pp(4, 2, 4, "1f1b", 4, 8)
    check_pp(4, 4, 2, "gpipe", 4, 8)  # GPipe runs with fewer micro-batches than stages


@pytest.mark.fast
@pytest.mark.parametrize("env, kw, message", [
    ("3", dict(pp=2), "does not divide the world size 3"),
    ("4", dict(pp=4, micro_batches=[2]), "micro_batches=2 < pp=4"),
    ("2", dict(pp=2, micro_batches=[3]), "batch_size=8 does not divide"),
    ("3", dict(pp=3), "n_layer=4 does not divide into pp=3")])
def test_worker_refuses_before_process_group(tmp_path, monkeypatch, env, kw, message):
    monkeypatch.setenv("WORLD_SIZE", env)
    with pytest.raises(ValueError, match=re.escape(message)): pp_worker(tmp_path, **kw)
    assert not dist.is_initialized()


@pytest.mark.fast
def test_other_errors():
    gpt = GPT(GPTConfig(**TINY))
    with pytest.raises(ValueError, match="choose a stage in 0..1"): GPTStage(gpt, 2, 2)
    with pytest.raises(ValueError, match="batch_size=6 does not divide"):
        split_micro_batches(torch.zeros(6, 4), torch.zeros(6, 4), 4)
