"Pipeline schedules past 1F1B on gloo: the lists; by hand and PyTorch's, equal to one process."
import json
import re

import fastcore.test as fc
import pytest
import torch
import torch.distributed as dist

import distcourse.schedules as sch
from conftest import PY, ROOT, run_cli, run_worker
from distcourse.gpt import GPT, GPTConfig
from distcourse.pipeline import bubble_fraction
from distcourse.schedules import (HAND, TORCH, actions, check_schedule, chunks_per_rank, in_flight,
                                  needs, replay_actions, sched_worker, stashing, weight_grads)

TOL = 1e-6  # fp32; measured ≤ 1.9e-8 against one process (sums in another order)
REL = 1e-5  # each gradient tensor against its own norm, and the gradient norm; measured ≤ 3.3e-7


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    "One launch on 2 processes, m = 4: interleaved 1F1B and ZB-H1 by hand, then PyTorch's four."
    out = tmp_path_factory.mktemp("sched")
    run_worker("schedules", "sched_worker", out, 2, timeout=180,  # a hang fails, not stalls
               pp=2, micro_batches=4, hand=("interleaved", "zb-h1"), torch_names=tuple(TORCH))
    return json.loads((out / "sched2.json").read_text())


def assert_equal_to_one_process(res, api, names):
    assert sorted(res[api]) == sorted(names), res[api].keys()
    for name, out in res[api].items():
        assert abs(out["loss"] - res["ref_loss"]) <= TOL, (api, name, out["loss"], res["ref_loss"])
        assert out["grad_diff"] <= TOL, (api, name, out["grad_diff"])
        assert out["grad_rel"] <= REL and out["norm_diff"] <= REL, (api, name, out["grad_rel"], out["norm_diff"])
        assert out["missing"] == [], (api, name, out["missing"])  # every parameter was compared


def test_by_hand_equal_to_one_process(res):
    "Interleaved 1F1B and ZB-H1 by hand: loss, every gradient, each rank's order and holdings."
    assert_equal_to_one_process(res, "hand", ("interleaved", "zb-h1"))
    for name, out in res["hand"].items():
        for r in range(2):
            mine = sorted((e for e in out["timeline"] if e["stage"] == r), key=lambda e: e["start"])
            want = actions(name, r, 2, 4)
            assert [(e["chunk"], e["mb"], e["kind"]) for e in mine] == want
            assert max(e["in_flight"] for e in mine) == in_flight(want, name == "zb-h1")


def test_torch_schedules_equal_to_one_process(res):
    "Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble and DualPipeV, PyTorch's."
    assert_equal_to_one_process(res, "torch", tuple(TORCH))


# Zero bubble for real: B gives dx only (SplitLinear stashes (x, dy)), W runs the stashed matmuls. Planted in the
# launched processes (forks of the interpreter that patches the module): a W that skips one micro-batch's stash,
# and a W whose stash is not emptied and runs again.
FAULTS = {
    "one W skipped": "w, calls = s.weight_grads, []\n"
                     "def fault(stash):\n    calls.append(1)\n    stash.clear() if len(calls) == 2 else w(stash)\n",
    "a stash run twice": "w = s.weight_grads\ndef fault(stash):\n    again = list(stash)\n    w(stash)\n    w(again)\n"}


def launch_zb(out, pp, m, fault=None):
    "ZB-H1 and 1F1B by hand on `pp` processes; `fault`: one of FAULTS planted in `weight_grads` first."
    plant = FAULTS[fault] + "s.weight_grads = fault\n" if fault else ""
    code = ("import sys\nfrom functools import partial\nimport distcourse.schedules as s\n"
            "from distcourse.launch import launch\n" + plant +
            f"launch(partial(s.sched_worker, pp={pp}, micro_batches={m}, hand=('1f1b', 'zb-h1')), (sys.argv[1],), "
            f"num_processes={pp}, timeout=120)\n")
    proc = run_cli([PY, "-c", code, str(out)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / f"sched{pp}.json").read_text())


@pytest.mark.fast
def test_zb_h1_p4_equal_to_one_process(tmp_path):
    "ZB-H1 with B (dx only) and W (the stashed matmuls) on 4 processes, m = 8: every gradient, the norm, the loss."
    res = launch_zb(tmp_path, 4, 8)
    assert_equal_to_one_process(res, "hand", ("1f1b", "zb-h1"))
    held = {name: [max(e["held"] for e in o["timeline"] if e["stage"] == r) for r in range(4)]
            for name, o in res["hand"].items()}
    assert held["1f1b"] == sorted(held["1f1b"], reverse=True), held  # 1F1B: p − stage micro-batches
    assert all(h > 0 for h in held["zb-h1"]) and held["zb-h1"][3] > held["1f1b"][3], held  # W's stash counted


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8)])
def test_zb_h1_fault_is_caught(tmp_path, fault, pp, m):
    "The planted fault changes ZB-H1's gradients (1F1B, which has no W, stays equal): the proof can fail."
    res = launch_zb(tmp_path, pp, m, fault)
    assert_equal_to_one_process({**res, "hand": {"1f1b": res["hand"]["1f1b"]}}, "hand", ("1f1b",))
    with pytest.raises(AssertionError): assert_equal_to_one_process(res, "hand", ("1f1b", "zb-h1"))
    assert res["hand"]["zb-h1"]["grad_rel"] > 1e-2, res["hand"]["zb-h1"]["grad_rel"]


def split_vs_whole(fault=None) -> float:
    "One process, the tiny GPT (tied matrix, layernorms, biases): B then W against one backward, worst tensor."
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, n_positions=32, n_layer=2, n_head=4, n_embd=32)
    whole, split = GPT(cfg), GPT(cfg)
    split.load_state_dict(whole.state_dict())
    x = torch.randint(0, 64, (4, 17))
    whole(x[:, :-1], x[:, 1:])[1].backward()
    stash = []
    with stashing(split, stash): loss = split(x[:, :-1], x[:, 1:])[1]
    loss.backward()  # B: the embeddings' and layernorms' gradients, and dx through every Linear
    if fault == "one W skipped": stash.pop(0)
    if fault == "a stash overwritten": stash[0] = (stash[0][0], stash[0][1], torch.zeros_like(stash[0][2]))
    weight_grads(stash)
    assert stash == []  # W empties it
    return max(((p.grad - q.grad).norm() / q.grad.norm()).item()
               for p, q in zip(split.parameters(), whole.parameters()))


@pytest.mark.fast
def test_split_linear_b_then_w_equals_one_backward():
    "Every gradient (the tied wte: embedding's part in B, lm_head's in W) equal; each planted fault caught."
    assert split_vs_whole() <= REL
    for fault in ("one W skipped", "a stash overwritten"): assert split_vs_whole(fault) > 1e-2, fault


@pytest.mark.fast
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 4), (3, 6), (8, 16)])
@pytest.mark.parametrize("schedule", HAND)
def test_schedule_lists(schedule, p, m):
    "Every (chunk, mb, kind) once, W after its B, and the replay respects every dependency."
    n, kinds = chunks_per_rank(schedule), "FBW" if schedule == "zb-h1" else "FB"
    for r in range(p):
        acts = actions(schedule, r, p, m)
        assert sorted(acts) == sorted((c, i, k) for c in range(n) for i in range(m) for k in kinds)
        at = {a: k for k, a in enumerate(acts)}
        assert all(at[(c, i, "F")] < at[(c, i, "B")] for c, i, _ in acts)
        assert all(at[(c, i, "B")] < at[(c, i, "W")] for c, i, k in acts if k == "W")
    events = replay_actions(schedule, p, m)
    end = {(e["chunk"] * p + e["stage"], e["mb"], e["kind"]): e["end"] for e in events}
    for e in events:  # each piece of work starts after what it waits for has ended
        need = needs(schedule, e["stage"], (e["chunk"], e["mb"], e["kind"]), p)
        assert need is None or end[need] <= e["start"], (e, need)
    ratio = {"interleaved": (p - 1) / (2 * m), "zb-h1": (p - 1) / (3 * m)}.get(schedule, (p - 1) / m)
    assert bubble_fraction(events, p) == pytest.approx(ratio / (1 + ratio))


@pytest.mark.fast
def test_a_broken_list_is_caught():
    "Rank 0 runs B0 before F1, rank 1 leaves B0 last: each waits for the other, the replay says so."
    order = [actions("1f1b", r, 2, 4) for r in range(2)]
    order[0] = [order[0][1], order[0][0], *order[0][2:]]  # rank 0: F0 B0 F1 …
    order[1] = [a for a in order[1] if a != (0, 0, "B")] + [(0, 0, "B")]  # rank 1 waits for F1
    with pytest.raises(RuntimeError, match="deadlock"): replay_actions("1f1b", 2, 4, order=order)


@pytest.mark.fast
@pytest.mark.parametrize("args, message", [
    (("interleaved", 4, 6), "micro_batches=4"), (("1f1b", 4, 2), "micro_batches=2 < pp=4"),
    (("zb-h2", 2, 4), "choose one of"), (("gpipe", 1, 4), "at least 2 ranks")])
def test_check_schedule(args, message):
    with pytest.raises(ValueError, match=re.escape(message)): check_schedule(*args)


@pytest.mark.fast
def test_worker_refuses_before_process_group(tmp_path):
    with pytest.raises(ValueError, match="multiple of pp"):
        sched_worker(tmp_path, pp=4, micro_batches=6)
    assert not dist.is_initialized()


@pytest.mark.fast
def test_exercise_checks_refuse_wrong_answers():
    "The lesson's exercise checks, from the notebook: right answers pass, plausible wrong ones fail."
    nb = json.loads((ROOT / "nbs" / "05f_schedules.ipynb").read_text())
    cells = ("".join(c["source"]) for c in nb["cells"])
    cell = next(c for c in cells if "def check_held" in c)
    scope = {**vars(sch), "bubble_fraction": bubble_fraction}
    scope.update(test_eq=fc.test_eq, test_close=fc.test_close)
    exec(cell, scope)
    share, least, held, eager = (scope[f"check_{n}"] for n in
                                 ("interleaved_share", "min_micro_batches", "held", "eager"))
    share(3 / 19)
    fc.test_fail(lambda: share(3 / 11), contains="close")  # v forgotten: 1F1B's bubble
    fc.test_fail(lambda: share(3 / 16), contains="close")  # the ratio, not the share of the step
    least(16)
    fc.test_fail(lambda: least(28), contains="==")  # v forgotten
    fc.test_fail(lambda: least(14), contains="==")  # not a multiple of p
    held(1, 8, 9)
    fc.test_fail(lambda: held(1, 1, 9), contains="==")  # B taken to free what W still needs
    def zb_eager(rank, pp, m):
        out = []
        for c, i, kind in actions("1f1b", rank, pp, m):
            out += [(c, i, kind)] + [(c, i, "W")] * (kind == "B")
        return out
    eager(zb_eager)
    fc.test_fail(lambda: eager(sch.zb_h1_actions), contains="==")  # ZB-H1 holds p on every rank
