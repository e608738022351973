"""Numbers in the lessons' prose say where they come from: a lesson's "What to remember" that quotes numbers
names the date, the machine and the command that measured them (the cells above it print each one)."""
import json
import re

import pytest

from conftest import ROOT

pytestmark = pytest.mark.fast  # every test here is quick: in the fast tier

LESSONS = sorted((ROOT / "nbs").glob("*.ipynb"))
# what the label above a lesson's numbers says: a date, the machine, and the command that runs that lesson
LABEL = r"\*Measured 20\d\d-\d\d-\d\d.* on (\d+) cores of .*by `jupyter execute nbs/{name}`"


def remember(path) -> str:
    "The markdown of a lesson's 'What to remember' section, up to its next heading."
    text = "\n\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                       if c["cell_type"] == "markdown")
    section = text.split("## What to remember", 1)[1]
    return section.split("\n## ", 1)[0]


def test_every_lesson_has_a_remember_section():
    assert len(LESSONS) >= 29, [p.name for p in LESSONS]
    for path in LESSONS:
        assert "## What to remember" in path.read_text(), path.name


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_remembered_numbers_are_labelled(path):
    "Numbers in 'What to remember' come with their date, machine and the command that reproduces them."
    section = remember(path)
    bullets = "\n".join(l for l in section.splitlines() if not l.startswith("*Measured"))
    if not re.search(r"\d", bullets): return  # nothing measured to label
    label = " ".join(section.split())  # one line: the label may wrap anywhere but inside a code span
    assert re.search(LABEL.format(name=re.escape(path.name)), label), (
        f"{path.name}: its 'What to remember' quotes numbers without the label that says when, where and by "
        f"which command they were measured; start the section with '*Measured YYYY-MM-DD on 2 cores of ... by "
        f"`jupyter execute nbs/{path.name}`; ...*'")
