"""The README's commands are true: its trainer block, pasted in order into a fresh copy of the repository, runs
line by line, and every flag it and the pages it links to (CONTRIBUTING.md, docs/) show exists in the command's
--help. The README stays short (its figure made by a command it names, one row per lesson), and CONTRIBUTING.md
holds the full test command that .ci/run runs."""
import re
import shlex
import subprocess

import pytest

from conftest import PY, ROOT, copy_env, fresh_copy, run_cli

README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def trainer_block() -> list:
    "The command lines of the first bash block of the README's 'The trainer' section."
    section = README[README.index("### The trainer"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [l for l in block.splitlines() if l.strip() and not l.startswith("#")]


def test_trainer_block_runs_in_order(tmp_path):
    lines = trainer_block()
    assert len(lines) >= 5 and any("--resume" in l for l in lines), lines
    repo = fresh_copy(tmp_path / "distcourse")
    env = copy_env(repo)
    for line in lines:
        argv = shlex.split(line)
        if argv[0] == "python": argv[0] = PY
        if argv[:2] == ["accelerate", "launch"]:
            argv = [PY, "-m", "accelerate.commands.launch", *argv[2:]]
        proc = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"README line failed: {line}\n{proc.stderr[-3000:]}"
    assert (repo / "compare.png").stat().st_size > 0
    run = (repo / "runs/tiny/run.json").read_text()
    assert '"resumed_from"' in run and "step_10" in run


def flags_of(module) -> set:
    "The --flags a CLI's --help lists."
    proc = run_cli([PY, "-m", module, "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(re.findall(r"--\w+", proc.stdout))


@pytest.mark.parametrize("module", ["distcourse.train", "distcourse.generate", "distcourse.tracking"])
def test_readme_flags_exist(module):
    "Every --flag the README, CONTRIBUTING.md and docs/ pass to a course CLI is one that CLI accepts."
    used = set()
    for line in "".join(p.read_text() for p in PAGES).splitlines():
        m = re.search(rf"-m {re.escape(module)}\b(.*)", line)
        if m: used |= set(re.findall(r"(?<![\w-])--\w+", m.group(1).split("#")[0].replace("`", " ")))
    assert used, f"the README shows no flags of {module}"
    missing = used - flags_of(module)
    assert not missing, f"the docs use {sorted(missing)}, which `python -m {module} --help` does not list"


@pytest.mark.fast
def test_readme_is_short_and_maps_every_lesson():
    "At most 1,500 words; one row of the lesson map per notebook in nbs/, linked; every page it links exists."
    assert len(README.split()) <= 1500, f"README.md has {len(README.split())} words; move detail to docs/"
    lessons = sorted(p.name for p in (ROOT / "nbs").glob("[0-9]*.ipynb"))
    rows = re.findall(r"^\| \w+ \| \[[^]]+\]\(nbs/([^)]+\.ipynb)\)", README, re.M)
    assert sorted(rows) == lessons and len(rows) == len(set(rows)), set(lessons) ^ set(rows)
    for link in re.findall(r"\]\(((?:docs/|CONTRIBUTING)[^)#]*)", README): assert (ROOT / link).exists(), link


@pytest.mark.fast
def test_readme_figure_is_small_and_made_by_its_command():
    "The signature figure is committed, under 100 kB, and the README names the script that makes it."
    png = re.search(r"!\[[^]]*\]\((docs/[^)]+\.png)\)", README).group(1)
    assert (ROOT / png).stat().st_size < 100_000, (png, (ROOT / png).stat().st_size)
    script = re.search(r"`python (docs/\S+\.py)`", README).group(1)
    assert (ROOT / script).is_file() and png.split("/")[-1] in (ROOT / script).read_text()


@pytest.mark.fast
def test_contributing_holds_the_full_test_command_ci_runs():
    "CONTRIBUTING.md's full test command (moved from the README) is what .ci/run runs, line for line."
    text = (ROOT / "CONTRIBUTING.md").read_text()
    block = re.search(r"```bash\n(pip install -e \"\.\[dev,.*?)```", text, re.S).group(1)
    ci = (ROOT / ".ci/run").read_text()
    assert 'pip install -q -e ".[dev,deepspeed,wandb,browser,site]"' in ci and "[dev,deepspeed,wandb,browser,site]" in block
    for cmd in block.splitlines()[-1].split(" && "): assert cmd.replace("pytest --full", "pytest --full -q") in ci, cmd
    assert "export CI=1 WANDB_MODE=offline" in block and "export CI=1 WANDB_MODE=offline" in ci
