"""Run, in its own namespace, by the IPython start-up file that `python site/build.py` gives each lesson's kernel:
appends to $DISTCOURSE_FORK_LOG, one JSON object a line and in order, every `Accelerator` made, every Accelerate
state set up (accelerate's `skip_first_batches` makes one; without a process group it initialises no GPU), every
GPU initialised and every fork of the kernel's own process, each with the lines of the lesson that led to it. `tests/test_forks.py` reads the logs: a process forked after an Accelerator or a GPU was set up in the kernel
cannot use the GPU ("Cannot re-initialize CUDA in forked subprocess"). The wrapped originals run unchanged."""
import functools
import importlib.abc
import importlib.util
import json
import os
import re
import sys
import traceback

_LOG, _KERNEL = os.environ.get("DISTCOURSE_FORK_LOG"), os.getpid()


def _cell_lines() -> dict:
    "The lines of the lesson's code that led here: the cell's statement and the innermost line of a cell's code."
    lines = [(f.line or "").strip() for f in traceback.extract_stack()  # cells: /tmp/ipykernel_<pid>/<hash>.py
             if re.search(r"ipykernel_\d+[/\\]", f.filename) or f.filename.startswith("<ipython-input")]
    return {"cell": lines[0], "line": lines[-1]} if lines else {"cell": "", "line": ""}


def record(event, **more):
    "Append one event of the kernel's process to the log (the forked processes' own events are not the kernel's)."
    if _LOG and os.getpid() == _KERNEL:
        with open(_LOG, "a") as f: f.write(json.dumps({"event": event, **_cell_lines(), **more}) + "\n")


def _cuda_initialized() -> bool:
    return "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()


def _wrap(owner, name, event, what, first_only=None):
    "Record `event` each time `owner.name` is called (or only when `first_only()` is true before the call)."
    original = getattr(owner, name)

    @functools.wraps(original)
    def recorded(*args, **kwargs):
        first = first_only is None or first_only()
        out = original(*args, **kwargs)
        if first: record(event, what=what)  # after the call: an attempt that raised set nothing up
        return out
    setattr(owner, name, recorded)


def _lazy_init_of(module):
    if hasattr(module, "_lazy_init"):
        _wrap(module, "_lazy_init", "device", module.__name__, lambda: not module.is_initialized())


PATCHES = {  # module: what to wrap once it has been imported (nothing is imported early)
    "accelerate.accelerator": lambda m: _wrap(m.Accelerator, "__init__", "accelerator", "Accelerator()"),
    "accelerate.state": lambda m: _wrap(m.PartialState, "__init__", "state", "Accelerate state",  # for reading:
                                        lambda: not m.PartialState._shared_state),  # it picks no GPU by itself
    "torch.cuda": _lazy_init_of,
    "torch.xpu": _lazy_init_of,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    "Applies PATCHES to a module right after its first import."
    def find_spec(self, name, path, target=None):
        if name not in PATCHES: return None
        sys.meta_path.remove(self)  # the real finders find it
        try: spec = importlib.util.find_spec(name)
        finally: sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"): return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            PATCHES.pop(name)(module)
        spec.loader.exec_module = exec_and_patch
        return spec


if _LOG:
    for name in [n for n in PATCHES if n in sys.modules]: PATCHES.pop(name)(sys.modules[name])  # imported already
    sys.meta_path.insert(0, _AfterImport())
    os.register_at_fork(before=lambda: record("fork", cuda=_cuda_initialized()))  # os.fork: multiprocessing's too
