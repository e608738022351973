"""The README's commands are true: its trainer block, pasted in order into a fresh copy of the repository, runs
line by line, and every flag it shows exists in the command's --help."""
import re
import shlex
import subprocess

import pytest

from conftest import PY, ROOT, copy_env, fresh_copy, run_cli

README = (ROOT / "README.md").read_text()


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
    "Every --flag the README passes to a course CLI is one that CLI accepts."
    used = set()
    for line in README.splitlines():
        m = re.search(rf"-m {re.escape(module)}\b(.*)", line)
        if m: used |= set(re.findall(r"(?<![\w-])--\w+", m.group(1).split("#")[0].replace("`", " ")))
    assert used, f"the README shows no flags of {module}"
    missing = used - flags_of(module)
    assert not missing, f"the README uses {sorted(missing)}, which `python -m {module} --help` does not list"
