"`distcourse.launch`: real process groups from `launch`, loud failures, free ports, launchers from the shell."
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from accelerate.state import PartialState
from accelerate.utils import patch_environment
from tqdm.std import TqdmDefaultWriteLock, tqdm

from conftest import ACCELERATE, PY, ROOT
from distcourse.launch import (_fresh_accelerate_state, accelerator_worker, free_port, hello_worker, launch,
                               make_accelerator, verify_world_size)

CPU = {"ACCELERATE_USE_CPU": "true"}  # gloo on CPU, on machines with a GPU too


def reports(d, pattern="*.json"):
    return [json.loads(p.read_text()) for p in sorted(Path(d).glob(pattern))]


def test_two_processes_form_one_gloo_group(tmp_path):
    launch(accelerator_worker, (tmp_path,), num_processes=2, **CPU)
    seen = reports(tmp_path)
    assert [(s["num_processes"], s["process_index"]) for s in seen] == [(2, 0), (2, 1)]
    assert {(s["distributed_type"], s["backend"]) for s in seen} == {("MULTI_CPU", "gloo")}
    assert [s["sum"] for s in seen] == [3.0, 3.0]  # 1 + 2, the same on both ranks
    assert not PartialState._shared_state          # nothing left behind in this process


def test_raw_processes_on_the_given_port(tmp_path):
    port = free_port()
    launch(hello_worker, (tmp_path,), num_processes=2, port=port)
    seen = reports(tmp_path)
    assert [r["rank"] for r in seen] == [0, 1] and {r["world"] for r in seen} == {2}
    assert [r["sum"] for r in seen] == [3.0, 3.0] and seen[0]["pid"] != seen[1]["pid"]
    assert {r["env"]["MASTER_PORT"] for r in seen} == {str(port)}


def _asks_for_two():
    verify_world_size(make_accelerator(), expected=2)


def test_verify_world_size_raises_on_mismatch(tmp_path):
    "In one process, expected=2 raises, here; the launched process leaves no Accelerate state behind."
    with pytest.raises(RuntimeError, match=r"expected=2 but the Accelerator realised 1 process\(es\)"):
        launch(_asks_for_two, num_processes=1, **CPU)
    assert not PartialState._shared_state
    launch(accelerator_worker, (tmp_path,), num_processes=2, **CPU)  # so a 2-process launch still works
    assert len(reports(tmp_path)) == 2


def _full_precision(out_dir):
    Path(out_dir, "mp.json").write_text(json.dumps(make_accelerator().mixed_precision))


def test_an_earlier_accelerator_does_not_leak(tmp_path):
    "An Accelerator made in this process (bf16) neither blocks launches nor reaches the launched function."
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    try:
        Accelerator(cpu=True, mixed_precision="bf16")
        launch(_full_precision, (tmp_path,), num_processes=1, **CPU)
        assert json.loads((tmp_path / "mp.json").read_text()) == "no"
        launch(accelerator_worker, (tmp_path,), num_processes=2, **CPU)
        assert len(reports(tmp_path, "rank*.json")) == 2
        assert AcceleratorState().mixed_precision == "bf16"  # the caller's state is back
    finally:
        AcceleratorState._reset_state(reset_partial_state=True); GradientState._reset_state()


def _strict_plain(out_dir):
    from accelerate import Accelerator
    verify_world_size(Accelerator())


def test_failure_in_the_processes_reaches_the_caller(tmp_path):
    with pytest.raises(Exception, match="realised 1 process"):
        launch(_strict_plain, (tmp_path,), num_processes=2, ACCELERATE_USE_CPU="false")


def test_mixed_precision_through_the_environment(tmp_path):
    launch(accelerator_worker, (tmp_path,), num_processes=2, ACCELERATE_MIXED_PRECISION="bf16", **CPU)
    assert {s["mixed_precision"] for s in reports(tmp_path)} == {"bf16"}


def _where_and_what(x):
    acc = make_accelerator()
    return {"pid": os.getpid(), "twice": 2 * x, "num_processes": acc.num_processes, "t": torch.arange(3)}


def test_one_process_runs_in_a_fork_and_returns_its_result():
    "The kernel never sets up an Accelerator: a GPU initialised there would be unusable in any later fork."
    got = launch(_where_and_what, (21,), num_processes=1, **CPU)
    assert got["pid"] != os.getpid() and (got["twice"], got["num_processes"]) == (42, 1)
    assert torch.equal(got["t"], torch.arange(3))  # a tensor comes back whole (copied, not shared memory)
    assert not PartialState._shared_state


def _fails_deep_down():
    raise ValueError("keep=0: keep at least 1 checkpoint")


def test_one_process_error_is_raised_here_with_its_traceback():
    with pytest.raises(ValueError, match="keep=0") as e:
        launch(_fails_deep_down, num_processes=1, **CPU)
    assert "in _fails_deep_down" in str(e.value.__cause__)  # the launched process's own traceback


class _NeedsTwoArgs(Exception):
    def __init__(self, what, code): super().__init__(what); self.code = code


def _unpicklable_error(): raise _NeedsTwoArgs("no such run", 3)
def _returns_a_generator(): return (i for i in range(3))
def _dies(): os._exit(3)


def test_one_process_results_that_cannot_come_back():
    with pytest.raises(TypeError, match="a generator, which cannot be pickled back: return plain data"):
        launch(_returns_a_generator, num_processes=1)
    with pytest.raises(RuntimeError, match="_NeedsTwoArgs: no such run"):  # rebuilt from its text
        launch(_unpicklable_error, num_processes=1)
    with pytest.raises(ChildProcessError, match="the launched process died, exit code 3"):
        launch(_dies, num_processes=1)


def _sleeps(): time.sleep(600)


def test_one_process_timeout():
    before = {c.pid for c in psutil.Process().children()}
    with pytest.raises(TimeoutError, match="still running after 1 s were stopped"):
        launch(_sleeps, num_processes=1, timeout=1)
    left = [c for c in psutil.Process().children() if c.pid not in before and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, left


def _layer_norms(threads=2):
    torch.set_num_threads(threads)
    x = torch.randn(256, 4096)
    for _ in range(10): torch.nn.functional.layer_norm(x, (4096,))  # an OpenMP parallel region, on 2 threads
    return "done"


def test_a_fork_after_openmp_work_does_not_hang():
    "GNU OpenMP's thread pool does not survive a fork (a forked process that used it waited for ever): freed first."
    before = torch.get_num_threads()
    try:
        _layer_norms()  # this process's OpenMP threads exist now
        assert launch(_layer_norms, num_processes=1, timeout=30) == "done"
    finally: torch.set_num_threads(before)


def _a_bar():
    tqdm(range(3), disable=True)  # takes tqdm's lock, as every bar of datasets does, shown or not
    return "done"


def test_a_fork_while_tqdm_lock_is_held_does_not_hang():
    "tqdm's monitor thread holds tqdm's lock an instant every 10 s: a fork then must not hand the child a held copy."
    held, go = threading.Event(), threading.Event()
    def hold():
        with TqdmDefaultWriteLock.th_lock: held.set(); go.wait(2)  # released after 2 s at most
    t = threading.Thread(target=hold); t.start(); held.wait()
    try: assert launch(_a_bar, num_processes=1, timeout=20) == "done"  # the fork waits for the lock
    finally: go.set(); t.join()


KILLED_HOLDING_THE_LOCK = """
import multiprocessing, os, signal
from tqdm.std import TqdmDefaultWriteLock, tqdm
from distcourse.launch import launch
tqdm(range(1), disable=True)  # tqdm's cross-process lock exists now, shared by every process forked from here
shared = TqdmDefaultWriteLock.mp_lock
def dies_holding_it(): shared.acquire(); os.kill(os.getpid(), signal.SIGKILL)  # as a rank stopped mid-bar
def a_bar(): tqdm(range(3), disable=True); return "done"
killed = multiprocessing.get_context("fork").Process(target=dies_holding_it); killed.start(); killed.join()
print(launch(a_bar, num_processes=1, timeout=20))
"""


def test_a_process_killed_holding_tqdm_lock_blocks_no_later_launch():
    "A process killed inside tqdm's cross-process lock leaves it held for ever: a later launch's bars must not wait."
    proc = subprocess.run([PY, "-c", KILLED_HOLDING_THE_LOCK], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr[-2000:]


def test_bad_num_processes():
    with pytest.raises(ValueError, match="num_processes=0"):
        launch(print, num_processes=0)


def test_free_ports_are_distinct_and_usable():
    ports = [free_port() for _ in range(4)]
    assert len(set(ports)) == 4 and 29500 not in ports
    for p in ports:
        with socket.socket() as s: s.bind(("127.0.0.1", p))  # raises if it were taken


def test_two_launches_at_once(tmp_path):
    "Two notebooks launching at the same time (as under nbdev_test) both succeed, on different ports."
    code = "import sys; from distcourse.launch import launch, hello_worker; launch(hello_worker, (sys.argv[1],))"
    outs = [tmp_path / "a", tmp_path / "b"]
    for o in outs: o.mkdir()
    procs = [subprocess.Popen([PY, "-c", code, str(o)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for o in outs]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    runs = [reports(o) for o in outs]
    assert all([r["sum"] for r in run] == [3.0, 3.0] for run in runs)
    ports = [run[0]["env"]["MASTER_PORT"] for run in runs]
    assert ports[0] != ports[1] and "29500" not in ports


# `accelerate launch` / torchrun from the shell, checked by `python -m distcourse.launch`.
LAUNCHERS = {
    "--multi_gpu --num_processes 2": (0, "ok: 2 process(es), MULTI_CPU"),
    "--num_processes 2": (1, "was given several processes but started one"),   # no --multi_gpu: one process
    "--cpu --num_processes 2": (1, "was given several processes but started one"),
    "--num_processes 1": (0, "ok: 1 process(es)"),                            # no false alarm
}


@pytest.fixture(scope="module")
def shell_launches():
    "All launcher command lines at once (each takes a few seconds to start)."
    procs = {flags: subprocess.Popen([*ACCELERATE, *flags.split(), "--main_process_port", str(free_port()),
                                      "-m", "distcourse.launch"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **CPU})
             for flags in LAUNCHERS}
    procs["torchrun"] = subprocess.Popen(
        [PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         "-m", "distcourse.launch"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **CPU})
    return {k: (p.wait(timeout=300), *p.communicate()) for k, p in procs.items()}


@pytest.mark.parametrize("flags", list(LAUNCHERS))
def test_accelerate_launch_flags(shell_launches, flags):
    rc, out, err = shell_launches[flags]
    want_rc, want = LAUNCHERS[flags]
    assert (rc != 0) == bool(want_rc), err[-3000:]
    assert want in (out if want_rc == 0 else err), (out, err[-3000:])
    if want_rc == 0: assert out.count("ok:") == 1  # only the main process reports


def test_torchrun(shell_launches):
    rc, out, err = shell_launches["torchrun"]
    assert rc == 0, err[-3000:]
    assert "ok: 2 process(es), MULTI_CPU, backend gloo, ranks [0, 1]" in out


def test_two_nodes_without_multi_gpu_are_refused(tmp_path):
    "Two `accelerate launch --num_machines 2` without --multi_gpu on CPU: each 'node' fails alone, with one line."
    port = str(free_port())
    procs = [subprocess.Popen([*ACCELERATE, "--num_machines", "2", "--machine_rank", str(rank), "--num_processes", "2",
                               "--main_process_ip", "127.0.0.1", "--main_process_port", port, "-m", "distcourse.train",
                               "--config", str(ROOT / "configs/tiny.yaml"), "--output_dir", str(tmp_path / f"n{rank}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **CPU})
             for rank in (0, 1)]
    for p in procs:
        rc, (_, err) = p.wait(timeout=300), p.communicate()
        lines = [l for l in err.splitlines() if l.startswith("distcourse.train: error: launch:")]
        assert rc != 0 and len(lines) == 1 and "started one" in lines[0], err[-3000:]
    assert not list(tmp_path.iterdir())  # refused before anything was written


def _hang(out_dir):
    "Rank 0 waits in a barrier that rank 1 never joins: a hang, as a missing collective makes one."
    import time
    import torch.distributed as dist
    dist.init_process_group("gloo")
    Path(out_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    if dist.get_rank() == 0: dist.barrier()
    else: time.sleep(600)


def _running(pid) -> bool:
    "Whether process `pid` still runs (a zombie, killed but not yet reaped, does not)."
    import psutil
    try: return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess: return False


def test_a_hang_is_stopped_and_said(tmp_path):
    with pytest.raises(TimeoutError, match="processes still running after 10 s were stopped") as e:
        launch(_hang, (tmp_path,), num_processes=2, timeout=10, **CPU)
    said = str(e.value).split("Where each process waited:")[1]  # each rank's stacks, innermost call first
    assert "in barrier" in said and "in _hang" in said, said  # rank 0 in the collective, rank 1 asleep in _hang
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("*.pid"))]
    assert len(pids) == 2, pids                       # both ranks ran ...
    assert not [p for p in pids if _running(p)], pids  # ... and neither is left running


def _siblings_at_start(out_dir):
    "Worker: the processes that exist when this one's function begins (the start line first), twice through it."
    import multiprocessing
    from distcourse.launch import _start_line
    _start_line()
    alive = [c.pid for c in psutil.Process(os.getppid()).children()]
    _start_line()  # a second Accelerator in the same process: passes at once, its siblings long gone
    Path(out_dir, f"{os.environ['LOCAL_RANK']}.json").write_text(json.dumps(
        {"pid": os.getpid(), "alive": alive, "forked": multiprocessing.parent_process() is not None}))
    time.sleep(3)  # stay alive while the others look


def test_no_process_starts_before_all_are_forked(tmp_path):
    """A process forked while another thread of the launching one holds a lock inherits it held (measured: glibc's
    resolver lock, taken by the store thread for the first processes' connections, hung the last one's connection).
    So every launched function starts only when all processes exist, a process passes the start line once, and the
    last one through removes it (here under a plain notebook_launcher, as lesson 10 launches `train`)."""
    from accelerate import notebook_launcher
    port = free_port()
    with _fresh_accelerate_state(), patch_environment(**CPU):
        notebook_launcher(_siblings_at_start, (tmp_path,), num_processes=4, use_port=str(port))
    seen = reports(tmp_path)
    assert len(seen) == 4 and all(s["forked"] for s in seen), seen
    assert all({r["pid"] for r in seen} <= set(s["alive"]) for s in seen), seen  # all 4 existed at every start
    assert not Path(tempfile.gettempdir(), f"distcourse-start-{os.getpid()}-{port}").exists()  # removed by them


def test_make_accelerator_runs_the_start_line(monkeypatch):
    "A plain notebook_launcher(train, ...) forks without `launch`: make_accelerator holds each process at the line."
    import distcourse.launch as L
    calls = []
    monkeypatch.setattr(L, "_start_line", lambda: calls.append("held"))
    with _fresh_accelerate_state(): L.make_accelerator()
    assert calls == ["held"]


def _uneven(out_dir):
    "Rank 1 returns a second after rank 0; each records when it returned and when it left the process group."
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, destroy = dist.get_rank(), dist.destroy_process_group
    def leave(*args, **kwargs):  # what launch's _worker calls once fn has returned
        Path(out_dir, f"left{rank}").write_text(str(time.time()))
        return destroy(*args, **kwargs)
    dist.destroy_process_group = leave  # in this forked process only
    if rank == 1: time.sleep(1)
    Path(out_dir, f"returned{rank}").write_text(str(time.time()))
    return "done"


def test_ranks_leave_together_at_a_finish_line(tmp_path):
    "Each launched process waits at a finish line (files, no collective) once `fn` returns; the line is removed."
    launch(_uneven, (tmp_path,), num_processes=2, timeout=60)
    when = lambda name: float((tmp_path / name).read_text())
    assert when("left0") >= when("returned1")  # rank 0 left the group only after rank 1's fn had returned
    assert not list(Path(tempfile.gettempdir()).glob(f"distcourse-finish-{os.getpid()}-*"))
    assert not list(Path(tempfile.gettempdir()).glob(f"distcourse-start-{os.getpid()}-*"))


def _one_group():
    "A process group of one, made by `fn` itself in a one-process launch (no launcher variables around it)."
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    return dist.get_world_size()


def test_a_one_process_group_leaves_without_siblings():
    assert launch(_one_group, num_processes=1, timeout=60) == 1
