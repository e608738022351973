"""`launch` on a machine where a fork cannot train (GPUs visible, and this process has used CUDA or autograd): it
spawns the processes instead, `fn` sent by value. Forced here with DISTCOURSE_START_METHOD, since only a GPU machine
makes the fork unsafe; benchmarks/gpu_one.py runs the lessons that need it on one."""
import os

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

import distcourse.launch as L
from distcourse.launch import fork_safe, hello_worker, launch, start_method

pytestmark = pytest.mark.fast
CPU = {"ACCELERATE_USE_CPU": "true"}


def _reads_marker(offset):
    "What a launched process sees: a module attribute set in the launching process, its pid, its argument."
    return getattr(L, "_test_marker", None), os.getpid(), offset + 1


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_one_process_gets_the_function_and_only_a_fork_gets_this_processes_changes(monkeypatch, method):
    "A closure and its argument reach the process either way; a change made here to a module reaches a fork alone."
    monkeypatch.setenv("DISTCOURSE_START_METHOD", method)
    monkeypatch.setattr(L, "_test_marker", "set here", raising=False)
    base = 41
    marker, pid, value = launch(lambda: _reads_marker(base), num_processes=1, **CPU)
    assert value == 42 and pid != os.getpid()
    assert marker == ("set here" if method == "fork" else None)


def test_spawned_processes_form_one_group(monkeypatch, tmp_path):
    "Two spawned processes join one gloo group through torch's elastic agent and all-reduce (1 + 2 on each)."
    monkeypatch.setenv("DISTCOURSE_START_METHOD", "spawn")
    assert launch(hello_worker, (tmp_path,), num_processes=2, timeout=120) is None  # as a forked launch
    ranks = sorted((p.name, p.read_text()) for p in tmp_path.glob("rank*.json"))
    assert len(ranks) == 2 and all('"sum": 3.0' in text for _, text in ranks), ranks


def test_a_spawned_error_reaches_the_caller(monkeypatch):
    monkeypatch.setenv("DISTCOURSE_START_METHOD", "spawn")
    def fails(): raise ValueError("planted")
    with pytest.raises(ChildFailedError, match="ValueError: planted"):  # the agent's report holds the traceback
        launch(fails, num_processes=1, timeout=120, **CPU)


def test_fork_is_kept_where_it_can_train(monkeypatch, capsys):
    "No GPU: fork, no probe. A GPU machine (stubbed) whose backward works in a fork: fork; one where it fails: spawn."
    monkeypatch.delenv("DISTCOURSE_START_METHOD", raising=False)
    assert fork_safe() and start_method() == "fork"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fork_safe()  # the probe's backward ran in a fork of this process
    def refused(*a, **k): raise RuntimeError("Unable to handle autograd's threading in combination with fork")
    monkeypatch.setattr(torch.Tensor, "backward", refused)  # the fork inherits it, as it would autograd's flag
    assert not fork_safe() and start_method() == "spawn"
    assert "spawning" in capsys.readouterr().out


def test_a_start_method_that_does_not_exist(monkeypatch):
    monkeypatch.setenv("DISTCOURSE_START_METHOD", "forkserver")
    with pytest.raises(ValueError, match="fork or spawn"): start_method()
