"""The lessons are committed with the outputs of their real-size execution (`python site/build.py`), and CI fails
when a lesson's code changed since its outputs were made (`python site/build.py --check`), naming the command that
refreshes it. Here: the committed lessons are fresh, hold a figure, stay under 1 MB and name no machine's paths;
and the check itself catches an edited lesson, an error, a lesson without figure, while a prose edit passes."""
import copy
import json
import re
import subprocess
import sys
import tempfile

import pytest

from conftest import ROOT, site_build

pytestmark = pytest.mark.fast

BUILD = site_build()


def lesson(tmp_path, cells) -> "Path":
    "A small stamped lesson: a title, a code cell with a figure, `cells` (code sources) after it."
    png = {"output_type": "display_data", "data": {"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"},
           "metadata": {}}
    nb = {"cells": [{"cell_type": "markdown", "id": "a", "metadata": {}, "source": ["# A lesson"]},
                    {"cell_type": "code", "id": "b", "metadata": {}, "execution_count": None,
                     "source": ["plt.plot([1, 2])"], "outputs": [png]}]
          + [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": None, "source": [src],
              "outputs": []} for i, src in enumerate(cells)],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    nb["metadata"]["distcourse"] = {"code": BUILD.code_hash(nb)}
    path = tmp_path / "99_lesson.ipynb"
    path.write_text(json.dumps(nb))
    return path


def edit(path, fn):
    nb = json.loads(path.read_text())
    fn(nb)
    path.write_text(json.dumps(nb))


def test_committed_lessons_are_fresh():
    stale = {p.stem: BUILD.problems(p) for p in BUILD.lessons() if BUILD.problems(p)}
    assert not stale, f"{stale}: refresh with `python site/build.py {' '.join(stale)}`"


def test_committed_outputs_name_no_machine_paths():
    found = {}
    for p in BUILD.lessons():
        text = json.dumps([c.get("outputs", []) for c in json.loads(p.read_text())["cells"]])
        if hits := re.findall(r"(?:/tmp/|/work/|/home/|/root/|/Users/)[\w./-]*", text): found[p.stem] = hits[:3]
    assert not found, f"outputs show a machine's paths (print paths relative to the run): {found}"


def test_check_catches_a_code_edit_not_a_prose_edit(tmp_path, capsys):
    path = lesson(tmp_path, ["x = 1\nprint(x)"])
    assert BUILD.problems(path) == []
    edit(path, lambda nb: nb["cells"][0].update(source=["# A lesson, retitled\n\nmore prose"]))
    assert BUILD.problems(path) == []  # prose does not change what the code prints
    edit(path, lambda nb: nb["cells"][2].update(source=["x = 2\nprint(x)"]))
    assert BUILD.problems(path) == ["its code changed since its outputs were made"]
    assert BUILD.check([path]) == ["99_lesson"]
    assert "refresh them (real sizes, their outputs written into nbs/): python site/build.py 99_lesson" in \
        capsys.readouterr().out


@pytest.mark.parametrize("fault, why", [
    (lambda nb: nb["metadata"].pop("distcourse"), "committed without outputs"),
    (lambda nb: nb["cells"][1].update(outputs=[]), "no figure in its outputs"),
    (lambda nb: nb["cells"][2]["outputs"].append({"output_type": "error", "ename": "E", "evalue": "",
                                                   "traceback": []}), "an error in its outputs"),
    (lambda nb: nb["cells"].insert(2, copy.deepcopy(nb["cells"][2])), "its code changed since its outputs were made"),
])
def test_check_catches_each_fault(tmp_path, fault, why):
    path = lesson(tmp_path, ["y = 3"])
    edit(path, fault)
    assert why in BUILD.problems(path)


def test_check_catches_a_lesson_over_a_megabyte(tmp_path):
    path = lesson(tmp_path, ["y = 3"])
    edit(path, lambda nb: nb["cells"][2]["outputs"].append(
        {"output_type": "stream", "name": "stdout", "text": "x" * 1_100_000}))
    assert any("MB with its outputs" in w for w in BUILD.problems(path))


def test_check_command_passes_fresh_lessons_and_refuses_an_ambiguous_name():
    ok = subprocess.run([sys.executable, str(ROOT / "site/build.py"), "--check", "00_data"], capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "outputs fresh" in ok.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "site/build.py"), "--check", "00"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "'00' names 2 lessons; one of: 00_data, 00a_loaders" in bad.stderr


def test_outputs_are_written_without_machine_paths():
    warning = f"{ROOT}/.venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: x\n"
    out = BUILD.scrubbed({"output_type": "stream", "name": "stderr", "text": warning})
    assert out["text"] == "torch/distributed/c10d_logger.py:83: FutureWarning: x\n"
    shown = BUILD.scrubbed({"output_type": "execute_result", "data": {"text/plain": [f"PosixPath('{ROOT}/data')"]}})
    assert shown["data"]["text/plain"] == "PosixPath('data')"
    assert BUILD.scrub(f"caches in {ROOT}") == "caches in ."
    assert BUILD.scrub(f"outputs in {tempfile.gettempdir()}/tmpab_12x/one/") == "outputs in <tmp>/one/"


def test_check_cells_are_folded_in_jupyterlab_and_left_off_the_site():
    unfolded, shown = [], []
    for p in BUILD.lessons():
        cells = json.loads(p.read_text())["cells"]
        hidden = [c for c in cells if c["cell_type"] == "code" and re.match(r"#\|\s*hide\b", "".join(c["source"]))]
        unfolded += [p.stem for c in hidden if not c["metadata"].get("jupyter", {}).get("source_hidden")]
        page = BUILD.page_of(p)["cells"]
        shown += [p.stem for c in page if re.match(r"#\|\s*hide\b", "".join(c["source"]))]
        assert len(page) == len(cells) - len(hidden), p.stem
    assert not unfolded, f"#| hide cells not collapsed (metadata jupyter.source_hidden): {unfolded}"
    assert not shown
