"""A dry run of the trainer's mesh step at the world size of an 8-GPU node, without a GPU.

Every rank's piece is built from real CPU weights, then moved by the mesh itself to a fake
accelerator ("fakegpu"): FakeTensorMode tensors that have shapes, dtypes and a device but no data,
so an op that meets a CPU tensor raises as it would on a GPU. The `fake` process-group backend runs
the collectives at any world size without peers; it accepts a CPU tensor silently (NCCL would not),
so every collective is wrapped to refuse a tensor that is not on the accelerator. Each rank runs the
real `Mesh.step`: forward, backward, gradient sums, clipping, AdamW, schedule.

Why not `cuda`: on a CPU-only torch build, slicing or `.to()` of a fake CUDA tensor reaches C++ code
that needs CUDA ("not linked with support for cuda devices"); a PrivateUse1 device with a Python
device guard behaves like a GPU for everything the mesh does (device checks, mismatches).
"""
import functools
import inspect
import os
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import PY, run_cli
from distcourse import mesh as mesh_module
from distcourse import pipeline
from distcourse.mesh import Mesh, mesh_layout
from distcourse.reshard import MeshState

GPU, WORLD, T = "fakegpu", 8, 16  # T: tokens per sequence, a multiple of 2 x cp for cp 8
# name: (tp, pp, cp, pp_schedule); dp = 8 / (tp·pp·cp). The model has 12 heads and 4 blocks, so
# tp 4 and pp 4 are the largest degrees it allows on 8 ranks (tp 8 would split 12 heads unevenly).
LAYOUTS = {"dp8": (1, 1, 1, "1f1b"), "dp2_tp4": (4, 1, 1, "1f1b"),
           "dp2_pp4_gpipe": (1, 4, 1, "gpipe"), "dp2_pp4_1f1b": (1, 4, 1, "1f1b"),
           "cp8": (1, 1, 8, "1f1b"), "dp2_tp2_pp2": (2, 2, 1, "1f1b"),
           "dp2_tp2_cp2": (2, 1, 2, "1f1b")}
# The dry run changes the interpreter it runs in (a renamed PrivateUse1 backend, a default process
# group of its own), and an earlier test may have left a default group: it runs in a fresh one.
INNER = os.environ.get("DISTCOURSE_DRY_RUN") == "1"
inner = pytest.mark.skipif(not INNER, reason="run by test_dry_run_in_its_own_interpreter")
COLLECTIVES = ("all_reduce", "broadcast", "send", "recv", "isend", "irecv", "all_gather",
               "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


class DeviceError(RuntimeError):
    "A collective was handed a tensor that is not on the accelerator."


class DryRun(FakeTensorMode):
    "Fake tensors whose `.item()` gives 1: a reported number has no value here; none is checked."
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1.0 if args[0].dtype.is_floating_point else 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.fixture(scope="module")
def hf():
    "A GPT-2 of 12 heads and 4 blocks, real CPU weights, no dropout, as the trainer builds it."
    if torch._C._get_privateuse1_backend_name() != GPU: _setup_privateuseone_for_python_backend(GPU)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=T, n_layer=4, n_head=12, n_embd=96,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def _module_to(real_to):
    "`Module.to` that moves parameters to the fake accelerator one by one, keeping tied ones tied."
    def to(self, *args, **kwargs):
        first = args[0] if args else None
        device = kwargs.get("device", first if isinstance(first, (str, torch.device)) else None)
        if device is None or torch.device(device).type != GPU: return real_to(self, *args, **kwargs)
        moved = {}  # id of a parameter -> its moved copy (the tied wte / lm_head matrix once)
        for m in self.modules():  # torch's own `.to` cannot swap a FakeTensor parameter in place
            for k, p in m._parameters.items():
                if p is None: continue
                if id(p) not in moved:
                    moved[id(p)] = nn.Parameter(p.detach().to(device), p.requires_grad)
                m._parameters[k] = moved[id(p)]
            for k, b in m._buffers.items():
                if b is not None: m._buffers[k] = b.to(device)
        return self
    return to


def _checked(name, fn, seen):
    "`fn`, refusing any tensor argument (or one in a list argument) that is not on the accelerator."
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else [a]):
                if isinstance(t, torch.Tensor) and t.device.type != GPU:
                    raise DeviceError(f"dist.{name} was handed a {tuple(t.shape)} tensor on "
                                      f"{t.device}: NCCL would refuse it; make it on the model's "
                                      f"device")
        seen.add(name)
        return fn(*args, **kwargs)
    return wrapper


@pytest.fixture
def seen(hf, monkeypatch):
    "Wrap the collectives (the names they were called by go in the returned set) and `Module.to`."
    names = set()
    for name in COLLECTIVES:
        monkeypatch.setattr(dist, name, _checked(name, getattr(dist, name), names))
    real_op, real_batch = dist.P2POp, dist.batch_isend_irecv
    def p2p(op, tensor, *args, **kwargs):  # P2POp accepts only the unwrapped isend / irecv
        return real_op(getattr(op, "__wrapped__", op), tensor, *args, **kwargs)
    def batch(ops):
        for op in ops: _checked("batch_isend_irecv", lambda t: None, names)(op.tensor)
        return real_batch(ops)
    monkeypatch.setattr(dist, "P2POp", p2p)
    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    monkeypatch.setattr(nn.Module, "to", _module_to(nn.Module.to))
    return names


def roles(tp, pp, cp) -> list:
    "Ranks that between them take every role: each stage of the first replica, and the last rank."
    layout = mesh_layout(WORLD, tp, pp, cp)
    return sorted({*layout["pp"][0], WORLD - 1})  # tp index 0, cp index 0 of replica 0; all last


def dry_step(hf, layout, rank) -> tuple:
    "Rank `rank` of `layout` builds its Mesh on the fake accelerator, steps: (mesh, result, state)."
    tp, pp, cp, schedule = LAYOUTS[layout]
    cfg = type("Cfg", (), dict(tp=tp, pp=pp, cp=cp, pp_schedule=schedule, lr=1e-3, weight_decay=0.1,
                               warmup_steps=1, max_steps=4))
    dist.init_process_group(f"cpu:fake,{GPU}:fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        with DryRun(allow_non_fake_inputs=True):
            mesh = Mesh(hf, cfg, device=GPU)
            dp, m = mesh.d["dp"], max(pp, 1)  # 1F1B needs as many micro-batches as stages
            batch = {k: torch.randint(0, 128, (2 * dp, T)) for k in ("input_ids", "labels")}  # CPU
            out = mesh.step([mesh.rows(batch) for _ in range(m)])
            state = MeshState(mesh).state_dict()  # what a checkpoint writes with dcp
        return mesh, out, state
    finally: dist.destroy_process_group()


def tensors(opt_state) -> list:  # an optimizer's state: {param or index: {name: value}}
    "Its tensors but AdamW's step counts, which torch keeps on the CPU on purpose (host-read)."
    return [v for s in opt_state.values() for k, v in s.items() if k != "step"]


@pytest.mark.skipif(INNER, reason="the inner run itself")
def test_dry_run_in_its_own_interpreter():
    "Every test below, in a fresh interpreter: each layout's dry run and the two planted bugs caught."
    proc = run_cli([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                   env={"DISTCOURSE_DRY_RUN": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert f"{len(LAYOUTS) + 2} passed" in proc.stdout, proc.stdout[-1000:]


@inner
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mesh_step_keeps_everything_on_the_device(hf, seen, layout):
    tp, pp, cp, _ = LAYOUTS[layout]
    for rank in roles(tp, pp, cp):
        mesh, out, saved = dry_step(hf, layout, rank)
        assert {p.device.type for p in mesh.model.parameters()} == {GPU}, (layout, rank)
        adam = tensors(mesh.opt.state)
        assert adam and {v.device.type for v in adam} == {GPU}, (layout, rank)  # AdamW stepped
        assert mesh.sched.last_epoch == 1 and set(out) == {"loss", "tokens", "grad_norm"}
        (piece,) = saved.values()
        written = [*piece["model"].values(), *tensors(piece["optimizer"]["state"])]
        assert {t.device.type for t in written} == {GPU}, (layout, rank)  # the checkpoint's
    want = {"all_reduce"}  # dp's gradient sums, and the loss and token counts
    if pp > 1: want |= {"isend", "recv", "broadcast"}  # activations, their gradients, the loss
    if cp > 1: want |= {"batch_isend_irecv"}  # the ring's K/V
    assert want <= seen, f"{layout}: the checked collectives saw {seen}, not {want}"


def _planted(module, fn, old, new):
    "`fn` recompiled from its source with `old` replaced by `new`: the real code but for one bug."
    source = textwrap.dedent(inspect.getsource(fn))
    assert old in source, f"{fn.__name__} no longer contains {old!r}"
    lines = source.replace(old, new).splitlines()
    source = "\n".join(line for line in lines if not line.startswith("@patch"))
    scope = {}
    exec(compile(source, inspect.getsourcefile(fn), "exec"), vars(module), scope)
    return scope[fn.__name__]


@inner
def test_a_cpu_accumulator_fails_the_dry_run(hf, seen, monkeypatch):
    "The mesh's loss accumulator made without device= (as it was): the CPU sum meets the loss."
    fixed = "torch.zeros((), device=self.device)"
    bad = _planted(mesh_module, Mesh._loss_sums, fixed, "torch.zeros(())")
    monkeypatch.setattr(Mesh, "_loss_sums", bad)
    with pytest.raises(RuntimeError, match="device"): dry_step(hf, "dp2_tp4", 0)


@inner
def test_a_cpu_buffer_in_a_collective_fails_the_dry_run(hf, seen, monkeypatch):
    "The pipeline's receive buffer on the CPU (as was): the fake backend takes it, the check not."
    fixed = "torch.empty(shape, device=device)"
    bad = _planted(pipeline, pipeline._recv, fixed, "torch.empty(shape)")
    monkeypatch.setattr(pipeline, "_recv", bad)
    with pytest.raises(DeviceError, match=r"dist.recv was handed a \(2, 16, 96\) tensor on cpu"):
        dry_step(hf, "dp2_tp2_pp2", 2)  # stage 1: it receives stage 0's activations first
