"""No lesson sets up an Accelerator or a GPU in its kernel and later forks the kernel: on a GPU machine the forked
processes could not use the GPU ("Cannot re-initialize CUDA in forked subprocess"). The evidence is the log each
lesson's kernel wrote while `python site/build.py --test` (which CI runs before the tests) executed it: every
Accelerator made, every GPU initialised, every fork, in order (site/record_forks.py). An Accelerate state alone
(accelerate's `skip_first_batches` makes one in lesson 07's kernel) is logged but allowed: without a process group
it picks the GPU as a device name and initialises nothing."""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, site_build

LOGS = ROOT / "site/_src/forks"
LESSONS = sorted((ROOT / "nbs").glob("[0-9]*.ipynb"))
FIX = ("make the Accelerator (and touch the GPU) only inside launched functions: launch(fn, num_processes=1) runs "
       "fn in a forked process too (lesson 02a)")


def kernel_events(lesson) -> list:
    "The events of the lesson's kernel, from the last site build; a missing or stale log fails under CI, else skips."
    log, why = LOGS / f"{lesson.stem}.jsonl", None
    lines = [json.loads(l) for l in log.read_text().splitlines()] if log.exists() else []
    if not lines: why = f"no kernel log of {lesson.stem}: run `python site/build.py --test` first"
    elif lines[0]["source"] != site_build().code_hash(json.loads(lesson.read_text())):
        why = f"{log.name} is from another version of {lesson.name}: run `python site/build.py --test` again"
    elif lines[-1]["event"] != "end": why = f"{lesson.stem} did not run to its end in the last site build"
    if why:
        if os.getenv("CI"): pytest.fail(why)
        pytest.skip(why)
    return lines[1:-1]


def fork_after_setup(events):
    "(what was set up, the fork after it) for the first fork after an Accelerator or a GPU was set up; else None."
    setup = None
    for e in events:
        if e["event"] == "fork" and (setup or e.get("cuda")): return setup or e, e
        if e["event"] in ("accelerator", "device") and setup is None: setup = e
    return None


def launches(lesson) -> bool:
    "Whether the lesson's code calls a launcher (launch, notebook_launcher), which forks."
    cells = json.loads(lesson.read_text())["cells"]
    return any(re.search(r"\b(launch|notebook_launcher)\(", "".join(c["source"])) for c in cells if c["cell_type"] == "code")


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_no_fork_after_an_accelerator_in_the_kernel(lesson):
    events = kernel_events(lesson)
    found = fork_after_setup(events)
    if found:
        setup, fork = found
        pytest.fail(f"{lesson.stem}: the kernel forked at `{fork['cell']}` after it set up {setup.get('what', 'CUDA')} "
                    f"itself at `{setup.get('line')}` (in `{setup['cell']}`); on a GPU machine the forked processes "
                    f"cannot use the GPU: {FIX}")
    if launches(lesson):  # the recorder saw this lesson's launches: an empty log would prove nothing
        assert any(e["event"] == "fork" for e in events), f"{lesson.stem} launches processes, but no fork was logged"


RECORDED = """
import os, sys
os.environ["DISTCOURSE_FORK_LOG"] = sys.argv[1]
import runpy; runpy.run_path(sys.argv[2])  # as site/build.py starts a lesson's kernel
from accelerate import Accelerator  # imported after the recorder, as in a lesson's kernel
if os.fork() == 0: os._exit(0)
Accelerator(cpu=True)
pid = os.fork()
if pid == 0: os._exit(0)
os.waitpid(pid, 0)
"""


def test_the_recorder_sees_accelerators_and_forks(tmp_path):
    "The recorder itself, in a plain interpreter: a fork, an Accelerator (its state first), the fork after it."
    log = tmp_path / "events.jsonl"
    proc = subprocess.run([sys.executable, "-c", RECORDED, str(log), str(ROOT / "site/record_forks.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [json.loads(l) for l in log.read_text().splitlines()]
    assert [(e["event"], e.get("what")) for e in events] == [
        ("fork", None), ("state", "Accelerate state"), ("accelerator", "Accelerator()"), ("fork", None)]
    assert fork_after_setup(events[:2]) is None and fork_after_setup(events) == (events[2], events[3])
