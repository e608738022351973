"""Every lesson has the course's arc (STYLE.md): What to remember, at least three exercises, each with a check cell,
and worked solutions that the tests run. (Each lesson's figure is checked on its page by tests/test_site.py.)"""
import json
import re

import pytest

from conftest import ROOT

LESSONS = sorted((ROOT / "nbs").glob("[0-9]*.ipynb"))


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
    checks = "".join(text for kind, text in s["Exercises"] if kind == "code")
    solved = "".join(text for kind, text in s["Solutions"] if kind == "code")
    defined = re.findall(r"^def (check_\w+)", checks, re.M)
    assert len(defined) >= 3, f"{path.name}: {len(defined)} check functions"
    unsolved = [f for f in defined if f"{f}(" not in solved]
    assert not unsolved, f"{path.name}: the Solutions never call {unsolved}"
