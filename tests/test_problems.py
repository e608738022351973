"""The parallelism lessons' problem sets ("predict, then the cell measures"), checked against the planner's own
functions (lessons 09b, 09bb, 09c): the answer each `Problem k` cell hands `check_prediction` (its cells run here as
a learner runs them) equals the planner's, and plausible wrong answers are refused by `check_prediction`, as a
learner's would be."""
import json
import re
from functools import lru_cache
from unittest.mock import patch

import pytest

from conftest import ROOT
from distcourse.comm import bus_factor
from distcourse.machine import Profile, collective_s
import distcourse.memory as memory_module
from distcourse.memory import check_prediction
from distcourse.plan import Layout, bubble, dp_messages, held, memory, rank_params
from distcourse.sizes import Shape

pytestmark = pytest.mark.fast  # the problem cells are arithmetic on the lessons' functions: seconds

GPT2 = Shape(name="gpt2-small", n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
PSI = 124_439_808  # GPT-2 small's parameters, as the problems state them


def state(L, dtype="fp32") -> float:
    "Bytes of model state a rank holds in the planner's memory model (params, gradients, optimizer)."
    m = memory(GPT2, L, 1024, dtype)
    return m["params"] + m["grads"] + m["optimizer"]


def sent(L) -> float:
    "Bytes one rank sends in a step's data-parallel messages (the planner's dp_messages), ring collectives."
    return sum(b * k * bus_factor(name, n) for name, b, n, k in dp_messages(GPT2, L, 4 * PSI))


def first(ok) -> int:
    return next(n for n in range(1, 10_000) if ok(n))


NIC = Profile("one NIC per GPU", 8, 1e15, 1.0, 80e9, (0.0, 50e9), (0.0, 50e9))  # 50 GB/s, latency left out
# lesson -> {problem: (the planner's answer, plausible wrong answers)}
PROBLEMS = {
    "05_memory": {
        1: (lambda: state(Layout(dp=8)), [12 * PSI, 16 * PSI / 8, 8 * PSI]),  # no grads; ZeRO-3's; bf16's
        2: (lambda: state(Layout(dp=8, zero_stage=2), "bf16"), [16 * PSI / 8, 5.5 * PSI, 16 * PSI]),  # z3, z1, DDP
        3: (lambda: first(lambda n: state(Layout(dp=n, zero_stage=1), "bf16") <= 0.75 * 2**30), [4, 8, 3])},
    "05a_zero": {
        1: (lambda: sent(Layout(dp=8, zero_stage=1)), [2 * 7 / 8 * 4 * PSI, 3 * 4 * PSI, 7 / 8 * 4 * PSI]),
        2: (lambda: sent(Layout(dp=8, zero_stage=3, grad_accum=4)),  # once a step; forward only; one reduction
            [3 * 7 / 8 * 4 * PSI, 2 * 4 * 7 / 8 * 4 * PSI, 9 * 7 / 8 * 4 * PSI]),
        3: (lambda: first(lambda n: n > 1 and collective_s(NIC, "all_reduce", 4 * PSI, n) > 2.0 / n),
            [101, 203, 100])},  # n - 1 for (n - 1)/n; one pass of the ring (or bf16's bytes); N - 1
    "05e_pipeline": {
        1: (lambda: bubble("1f1b", 4, 12), [3 / 12, 4 / 16, 3 / 16]),  # over busy time; p for p - 1; one slot more
        2: (lambda: held("1f1b", 4, 16, stage=1), [4, 16, 2]),  # stage 0's; GPipe's; p - stage - 1
        3: (lambda: 8 * 0.030 / (1 - bubble("1f1b", 4, 8)), [0.24, 0.36, 0.27])},  # no bubble; a slot more; fwd
}


def problem_cells(name) -> dict:
    "{k: the source of `Problem k`'s code cell} of a lesson, in order."
    out, k = {}, None
    for cell in json.loads((ROOT / "nbs" / f"{name}.ipynb").read_text())["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and (m := re.match(r"### Problem (\d+)", text)): k = int(m[1])
        elif cell["cell_type"] == "code" and k is not None: out[k], k = text, None
    return out


@lru_cache(maxsize=None)
def answers(name) -> dict:
    """{k: (the answer `Problem k`'s cell hands check_prediction, its rel)}: the lesson's imports, then its problem
    cells in order, run as a learner runs them with `guess = None` (the answer is not printed: it is recorded)."""
    cells = json.loads((ROOT / "nbs" / f"{name}.ipynb").read_text())["cells"]
    module = re.search(r"#\| default_exp (\S+)", "\n".join("".join(c["source"]) for c in cells))[1]
    imports = [line for c in cells if c["cell_type"] == "code" for line in "".join(c["source"]).splitlines()
               if re.match(r"(from \S+ )?import [^(]+$", line)]  # one-line imports, exported cells' and others'
    calls = []
    def record(guess, answer, rel=0.01, unit=""): calls.append((answer, rel))
    ns = {}
    exec("\n".join([*imports, f"from distcourse.{module} import *"]), ns)
    with patch.object(memory_module, "check_prediction", record):
        for k, code in problem_cells(name).items():
            assert "check_prediction(guess" in code, f"{name} problem {k}: its cell does not check a prediction"
            ns["check_prediction"] = record
            exec(code, ns)
            assert ns["guess"] is None, f"{name} problem {k}: committed with a guess filled in"
            assert len(calls) == k, f"{name} problem {k}: check_prediction called {len(calls) - k + 1} times"
    return dict(enumerate(calls, 1))


CASES = [(name, k) for name, probs in PROBLEMS.items() for k in probs]


@pytest.mark.parametrize("name", PROBLEMS)
def test_lesson_has_a_problem_set(name):
    "3-6 problems, numbered from 1, each with its cell and a folded worked answer after it."
    cells = json.loads((ROOT / "nbs" / f"{name}.ipynb").read_text())["cells"]
    heads = [i for i, c in enumerate(cells) if re.match(r"### Problem \d+", "".join(c["source"]))]
    assert 3 <= len(heads) <= 6 and sorted(answers(name)) == list(range(1, len(heads) + 1)) == sorted(PROBLEMS[name])
    for i in heads:
        assert cells[i + 1]["cell_type"] == "code", name
        assert "".join(cells[i + 2]["source"]).startswith("<details><summary>Worked answer"), (name, i)


def test_the_problems_are_on_the_planners_gpt2_small():
    assert rank_params(GPT2, Layout(dp=8)) == PSI


@pytest.mark.parametrize("name,k", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_answer_is_the_planners(name, k):
    "The lesson's answer, from its own functions, equals the planner's to the 6 digits printed."
    want, _ = PROBLEMS[name][k]
    assert answers(name)[k][0] == pytest.approx(want(), rel=1e-5)


@pytest.mark.parametrize("name,k", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_wrong_answers_are_refused(name, k, capsys):
    "check_prediction accepts the planner's answer and refuses each plausible wrong one, naming the right one."
    want, wrong = PROBLEMS[name][k]
    answer, rel = answers(name)[k]
    check_prediction(want(), answer, rel)
    assert "your prediction is right" in capsys.readouterr().out
    for w in wrong:
        with pytest.raises(AssertionError, match="answer: "): check_prediction(w, answer, rel)
