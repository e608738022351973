"""Every lesson has the course's arc (STYLE.md): What to remember, at least three exercises, each
with a check cell, and worked solutions that the tests run, where each check is also fed at least
three plausible wrong answers that it must refuse (one wrong answer proves little: a check that only
compares a shape, or a machine-dependent value that a wrong formula matches here, refuses one and
passes the rest). (Each lesson's figure is checked on its page by tests/test_site.py.)"""
import ast
import json
import re

import pytest

from conftest import ROOT

pytestmark = pytest.mark.fast  # every test here is quick: in the fast tier

LESSONS = sorted((ROOT / "nbs").glob("[0-9]*.ipynb"))
WRONG_ANSWERS = 3  # per check: the typical mistakes (off by one, the wrong divisor, the wrong axis), each refused


def sections(nb) -> dict:
    "{heading: [(cell type, text)] up to the next ## heading} of a notebook (a heading may start mid-cell)."
    out, current = {}, None
    for cell in nb["cells"]:
        text = "".join(cell["source"])
        parts = re.split(r"^## +(.+)$", text, flags=re.M) if cell["cell_type"] == "markdown" else [text]
        if current is not None and parts[0].strip(): current.append((cell["cell_type"], parts[0]))
        for heading, body in zip(parts[1::2], parts[2::2]):
            current = out.setdefault(heading.strip(), [])
            current.append((cell["cell_type"], body))
    return out


def failing_calls(code) -> list:
    "The text inside each `test_fail(...)` call of `code`, parentheses balanced."
    out = []
    for m in re.finditer(r"\btest_fail\(", code):
        depth, i = 1, m.end()
        while depth and i < len(code):
            depth += {"(": 1, ")": -1}.get(code[i], 0)
            i += 1
        out.append(code[m.end():i - 1])
    return out


def wrong_answers(code, check) -> int:
    """How many wrong answers `code` feeds `check` inside test_fail: one per call, times the length of each literal
    tuple, list or dict that a `for` loop around the call runs over (`for wrong in (a, b, c): test_fail(...)`)."""
    try: tree = ast.parse(code)
    except SyntaxError: return sum(bool(re.search(rf"\b{check}\(", c)) for c in failing_calls(code))
    def count(node, times):
        if isinstance(node, ast.For) and isinstance(node.iter, (ast.Tuple, ast.List, ast.Dict, ast.Set)):
            times *= len(node.iter.keys if isinstance(node.iter, ast.Dict) else node.iter.elts)
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "test_fail"
                and re.search(rf"\b{check}\(", ast.unparse(node))): return times
        return sum(count(child, times) for child in ast.iter_child_nodes(node))
    return count(tree, 1)


def fragment(call) -> str:
    "The literal text of a test_fail call's `contains=`, {fields} left out ('' if none)."
    m = re.search(r"contains=f?([\"'])(.*?)\1", call)
    return re.sub(r"\{[^}]*\}", "", m.group(2)).strip() if m else ""


def test_failing_calls():
    code = 'check_a(1)\ntest_fail(lambda: check_b(f(2)), contains="==")\ntest_fail(g, args=[c])'
    assert failing_calls(code) == ['lambda: check_b(f(2)), contains="=="', "g, args=[c]"]
    assert [fragment(c) for c in failing_calls(code)] == ["==", ""]
    assert fragment('f, contains=f"{msg}"') == ""  # "{msg}" may be "": it matches any error
    assert fragment("f, contains=f'at {n} steps'") == "at  steps"
    loop = ('for wrong in (1, 2, [3]):\n    test_fail(lambda: check_b(wrong), contains="==")\n'
            'test_fail(lambda: check_b(0))')
    assert wrong_answers(loop, "check_b") == 4 and wrong_answers(loop, "check_c") == 0


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_lesson_arc(path):
    s = sections(json.loads(path.read_text()))
    assert "What to remember" in s, f"{path.name}: no '## What to remember'"
    remember = s["What to remember"][0][1]
    assert len(re.findall(r"^- ", remember, re.M)) >= 3, f"{path.name}: What to remember has fewer than 3 lines"
    assert "Exercises" in s and "Solutions" in s, f"{path.name}: needs '## Exercises' and '## Solutions'"
    exercises = s["Exercises"][0][1]
    asked = re.findall(r"^(\d+)\. ", exercises, re.M)
    assert len(asked) >= 3, f"{path.name}: {len(asked)} exercises, the arc asks for 3-5"
    checks = "\n".join(text for kind, text in s["Exercises"] if kind == "code")  # a def may start a cell
    solved = "\n".join(text for kind, text in s["Solutions"] if kind == "code")
    defined = re.findall(r"^def (check_\w+)", checks, re.M)
    assert len(defined) >= 3, f"{path.name}: {len(defined)} check functions"
    unsolved = [f for f in defined if f"{f}(" not in solved]
    assert not unsolved, f"{path.name}: the Solutions never call {unsolved}"
    refused = failing_calls(solved)
    fed = {f: sum(wrong_answers(cell, f) for kind, cell in s["Solutions"] if kind == "code") for f in defined}
    few = {f: n for f, n in fed.items() if n < WRONG_ANSWERS}
    assert not few, f"{path.name}: fewer than {WRONG_ANSWERS} wrong answers fed inside test_fail(...): {few}"
    vague = [c for c in refused if re.search(r"\bcheck_\w+\(", c) and not fragment(c)]
    assert not vague, f"{path.name}: test_fail without contains='...' passes on any error: {vague}"
