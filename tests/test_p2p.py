"""Point-to-point by NCCL's rules, checked without NCCL (lesson 03a's `nccl_replay`): the pipelines' first order
(each message sent on its own when made, received when needed) is stuck, gloo's buffering hides it, and every
hand-written schedule planned in rounds (`p2p_rounds`, what 05e's `pipeline_step` and 05f's `run_schedule` run)
passes at p 2 and 4; faults in a plan are caught; no point-to-point call in the package passes a tag."""
import re

import pytest

from conftest import ROOT
from distcourse.comm import chain_msgs, nccl_replay, one_by_one, p2p_program, p2p_rounds
from distcourse.schedules import HAND, actions, chunks_per_rank

pytestmark = pytest.mark.fast  # pure Python: the calls are played, not run
OK = {"mismatches": [], "stuck": []}
CASES = [(name, p, m) for name in HAND for p in (2, 4) for m in (4, 8, 12)]


def work(name, pp, m) -> tuple:
    "Every rank's actions under hand schedule `name` and its messages (chunk c of rank r: virtual stage c·pp + r)."
    acts = {r: actions(name, r, pp, m) for r in range(pp)}
    return acts, chain_msgs(pp * chunks_per_rank(name), pp, lambda r, a: (a[0] * pp + r, a[1], a[2]))


def in_rounds(acts, msgs, plan=None) -> dict:
    plan = plan or p2p_rounds(acts, msgs)
    return {r: p2p_program(plan, msgs, r) for r in acts}


@pytest.mark.parametrize("name,p,m", CASES)
def test_every_schedule_in_rounds_keeps_nccls_rules(name, p, m):
    acts, msgs = work(name, p, m)
    plan = p2p_rounds(acts, msgs)
    assert nccl_replay(in_rounds(acts, msgs, plan)) == OK
    assert nccl_replay(in_rounds(acts, msgs, plan), eager=True) == OK
    for r in acts:  # each rank runs its own work in its own order, and every message is posted once on each side
        assert [a for kind, a in plan[r] if kind == "act"] == acts[r]
    ops = [op for r in plan for kind, group in plan[r] if kind == "post" for op in group]
    sends, recvs = sum(op[0] == "send" for op in ops), sum(op[0] == "recv" for op in ops)
    made = sum(msgs(r, a)[1] is not None for r in acts for a in acts[r])
    assert sends == recvs == made


@pytest.mark.parametrize("name,p,m", CASES)
def test_the_first_order_is_stuck_where_work_crosses(name, p, m):
    "Sent each on its own, the messages of every schedule but GPipe are stuck; buffered (gloo), all pass."
    acts, msgs = work(name, p, m)
    strict = nccl_replay(one_by_one(acts, msgs))
    assert bool(strict["stuck"]) == (name != "gpipe"), strict
    assert nccl_replay(one_by_one(acts, msgs), eager=True) == OK


def test_two_ranks_that_both_send_first_are_stuck_and_one_group_passes():
    first = {r: [("post", 0, [("send", 1 - r, r)]), ("post", 1, [("recv", 1 - r, 1 - r)]), ("wait", 1)] for r in (0, 1)}
    grouped = {r: [("post", 0, [("send", 1 - r, r), ("recv", 1 - r, 1 - r)]), ("wait", 0)] for r in (0, 1)}
    assert [s["rank"] for s in nccl_replay(first)["stuck"]] == [0, 1]
    assert nccl_replay(first, eager=True) == nccl_replay(grouped) == OK


def test_tags_are_ignored():
    "Rank 1 receives in another order than rank 0 sends: NCCL pairs them by order, so each lands in the wrong buffer."
    prog = {0: [("post", 0, [("send", 1, "a")]), ("post", 1, [("send", 1, "g")]), ("wait", 0), ("wait", 1)],
            1: [("post", 0, [("recv", 0, "g")]), ("post", 1, [("recv", 0, "a")]), ("wait", 0), ("wait", 1)]}
    got = nccl_replay(prog, eager=True)
    assert got["stuck"] == [] and [(x["sent"], x["expected"]) for x in got["mismatches"]] == [("a", "g"), ("g", "a")]


def test_faults_in_a_plan_are_caught():
    "A sender that posts two rounds' messages in the other order, or a round's sends before its receives, fails."
    acts, msgs = work("1f1b", 2, 8)
    plan = p2p_rounds(acts, msgs)
    swapped = {r: list(steps) for r, steps in plan.items()}
    i, j = [n for n, (kind, x) in enumerate(swapped[0]) if kind == "post" and x[0][0] == "send"][:2]  # rank 0's
    swapped[0][i], swapped[0][j] = ("post", swapped[0][j][1]), ("post", swapped[0][i][1])
    assert nccl_replay(in_rounds(acts, msgs, swapped), eager=True)["mismatches"]  # tags or not: the wrong buffers
    def sends_first(group):
        return [("post", [op for op in group if op[0] == k]) for k in ("send", "recv")
                if any(op[0] == k for op in group)]
    split = {r: [s for kind, x in steps for s in (sends_first(x) if kind == "post" else [(kind, x)])]
             for r, steps in plan.items()}
    assert nccl_replay(in_rounds(acts, msgs, split))["stuck"]  # 1F1B's crossing messages, as in 05e


def test_a_schedule_that_waits_on_itself_is_refused():
    acts = {0: [("need", 1)], 1: [("need", 0)]}  # each rank's first action waits for the other's message
    def msgs(r, action): return (1 - r, f"to {r}"), (1 - r, f"to {1 - r}")
    with pytest.raises(RuntimeError, match="waiting on itself"): p2p_rounds(acts, msgs)


def test_no_point_to_point_call_passes_a_tag():
    calls = re.compile(r"\b(isend|irecv|send|recv|P2POp)\(")
    for path in sorted((ROOT / "distcourse").glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not (calls.search(line) and "tag=" in line), f"{path.name}:{n} passes a tag: {line.strip()}"


def ring_program(r, cp, forward=True) -> list:
    """Rank r's calls in 05h's lean ring, as its code posts them: each hop one group (send to r + 1, receive from
    r - 1), posted before the step's compute; backward's gradient follows its block one hop behind, home last.
    Labels say which rank's block a message carries, so a pairing across blocks is a mismatch."""
    prog, nxt, back = [], None, None
    def hop(kind, step, gid):  # at `step` rank r holds rank r - step's block and receives r - 1 - step's
        prog.append(("post", gid, [("send", (r + 1) % cp, (kind, (r - step) % cp)),
                                   ("recv", (r - 1) % cp, (kind, (r - 1 - step) % cp))]))
        return gid
    for step in range(cp):
        nxt = hop("kv", step, ("kv", step)) if step < cp - 1 else None
        if not forward:
            if back: prog.append(("wait", back))
            back = hop("dkv", step, ("dkv", step))
        if nxt: prog.append(("wait", nxt))
    if back: prog.append(("wait", back))
    return prog


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_the_lean_rings_posted_hops_keep_nccls_rules(cp):
    "05h's ring, forward and backward, with two groups in flight at once (K/V and the gradient): paired, not stuck."
    for forward in (True, False):
        programs = {r: ring_program(r, cp, forward) for r in range(cp)}
        assert nccl_replay(programs) == OK and nccl_replay(programs, eager=True) == OK
    # a rank that posts its gradient before the next K/V (the others the other way round) pairs blocks wrongly
    programs = {r: ring_program(r, cp, False) for r in range(cp)}
    prog = programs[0]
    i = next(i for i, c in enumerate(prog) if c[0] == "post" and c[1] == ("dkv", 1))
    j = next(j for j, c in enumerate(prog) if c[0] == "post" and c[1] == ("kv", 1)) if cp > 2 else None
    if j is not None:
        prog[i], prog[j] = prog[j], prog[i]
        assert nccl_replay(programs)["mismatches"] or nccl_replay(programs)["stuck"]
