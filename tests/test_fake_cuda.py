"""A dry run of the trainer at the world size of an 8-GPU node, without a GPU: every layout it runs.

Every rank's piece is built from real CPU weights, then moved by the trainer's own code to a fake
accelerator ("fakegpu"): FakeTensorMode tensors that have shapes, dtypes and a device but no data,
so an op that meets a CPU tensor raises as it would on a GPU. The `fake` process-group backend runs
the collectives at any world size without peers; it accepts a CPU tensor silently (NCCL would not),
so every collective is wrapped to refuse a tensor that is not on the accelerator.

The mesh path (--tp/--pp/--cp): each rank runs the real `Mesh.step` (forward, backward, gradient
sums, clipping, AdamW, schedule) and builds the state a checkpoint writes (`MeshState`).

The non-mesh path (--zero_stage 0-3): rank 0 makes the real `Accelerator` (`make_accelerator`)
and the engine `train` makes (lesson 07c's `DataParallelEngine`): its `prepare` (the model moved,
`prepare_zero`, the states registered), then its `train_steps` (2 micro-batches: forward, backward,
`clip_grads`, optimizer, scheduler, the --grads_at gather), an
evaluation, its `_save` of a checkpoint (`save_checkpoint`: Accelerate's `save_state`,
`ShardedState`) and `full_state_dict` (the final model). ZeRO-2 by hand, which the trainer does not
build, saves with its optimizer's own `consolidate_state_dict`. What is not the real code, and why:
- Accelerate takes the run for MULTI_CPU (its device comes from ACCELERATE_TORCH_DEVICE); on GPUs it
  is MULTI_GPU, whose `prepare` builds the same DDP, with `device_ids`.
- DDP's C++ reducer reads tensor data (it checks parameter shapes across ranks, broadcasts and
  buckets in C++ that fake tensors cannot enter), so `HandDDP` stands in where Accelerate builds
  DDP: rank 0's state broadcast at wrap, then each gradient summed and divided by N once it is
  accumulated, not under `no_sync` (lesson 03's rule), through the checked collectives.
- The bytes are not written: torch.save, safetensors and dcp.save are replaced by recorders of what
  they are handed. dcp.save itself cannot run: its planning gathers pickles as byte tensors, which
  the fake mode makes fake. (On fake tensors safetensors sees one shared storage, keeps one tensor.)
- FSDP2's streams and events do nothing (ops run in order here); its DeviceMesh is made outside
  the fake mode (it is bookkeeping of ranks: fake tensors cannot say which rank is where).
- The batches are random token ids from a plain DataLoader that Accelerate prepares (shards, moves),
  not the trainer's corpus; tracking, the throughput meter and `run.json` do not run.
DTensor's gathers (FSDP2 clipping, `full_tensor`) go through functional collectives, which are not
wrapped: a CPU tensor there is caught only where it next meets a tensor on the device.

Why not `cuda`: on a CPU-only torch build, slicing or `.to()` of a fake CUDA tensor reaches C++ code
that needs CUDA ("not linked with support for cuda devices"); a PrivateUse1 device with a Python
device guard behaves like a GPU for everything the trainer does (device checks, mismatches).
"""
import copy
import functools
import inspect
import os
import textwrap
from contextlib import contextmanager, nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate.utils import patch_environment
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.backend_registration import (_DummyBackendModule,
                                              _setup_privateuseone_for_python_backend)
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import PY, run_cli
from distcourse import mesh as mesh_module
from distcourse import ddp, pipeline, zero
from distcourse.checkpoint import DataStream
from distcourse.config import Config
from distcourse.launch import _fresh_accelerate_state, make_accelerator
from distcourse.layout import ParallelDims, build_mesh
from distcourse.loop import make_scheduler
from distcourse.evaluation import evaluate_distributed
from distcourse.memory import _inner, track_memory
from distcourse.mesh import Mesh, mesh_layout
from distcourse.reshard import MeshState
from distcourse.engine import DataParallelEngine, first_batch
from distcourse.train import _grads_saver, _save

GPU, WORLD, T = "fakegpu", 8, 16  # T: tokens per sequence, a multiple of 2 x cp for cp 8
# name: (tp, pp, cp, pp_schedule); dp = 8 / (tp·pp·cp). The model has 12 heads and 4 blocks, so
# tp 4 and pp 4 are the largest degrees it allows on 8 ranks (tp 8 would split 12 heads unevenly).
LAYOUTS = {"dp8": (1, 1, 1, "1f1b"), "dp2_tp4": (4, 1, 1, "1f1b"),
           "dp2_pp4_gpipe": (1, 4, 1, "gpipe"), "dp2_pp4_1f1b": (1, 4, 1, "1f1b"),
           "cp8": (1, 1, 8, "1f1b"), "dp2_tp2_pp2": (2, 2, 1, "1f1b"),
           "dp2_tp2_cp2": (2, 1, 2, "1f1b")}
# name: (--zero_stage, stage 2's optimizer): what `prepare_zero` builds; dp 8. The trainer builds
# FSDP2 at stage 2; ZeRO-2 by hand (lesson 05a's FlatZero2Optimizer) is prepare_zero's other choice.
STAGES = {"ddp": (0, None), "zero1": (1, None), "zero2_by_hand": (2, zero.ZERO2["flat"]),
          "fsdp2_zero2": (2, None), "fsdp2_zero3": (3, None)}
# The dry run changes the interpreter it runs in (a renamed PrivateUse1 backend, a default process
# group of its own), and an earlier test may have left a default group: it runs in a fresh one.
INNER = os.environ.get("DISTCOURSE_DRY_RUN") == "1"
inner = pytest.mark.skipif(not INNER, reason="run by test_dry_run_in_its_own_interpreter")
COLLECTIVES = ("all_reduce", "broadcast", "send", "recv", "isend", "irecv", "all_gather",
               "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
               "all_gather_single", "reduce_scatter_single")  # the last two: ZeRO's and FSDP2's


class DeviceError(RuntimeError):
    "A collective was handed a tensor that is not on the accelerator."


class FakeStreams(_DummyBackendModule):
    "`torch.fakegpu`: FSDP2 overlaps on streams; here ops run in order, so they do nothing."
    class Event:
        def record(self, stream=None): return None
        def wait(self, stream=None): return None
        def synchronize(self): return None
        def query(self): return True
    class Stream:
        def __init__(self, *args, **kwargs): pass
        def wait_stream(self, other): return None
        def wait_event(self, event): return None
        def record_event(self, event=None): return event or FakeStreams.Event()
        def synchronize(self): return None
    _current = Stream()
    def current_stream(self, device=None): return self._current
    def stream(self, stream): return nullcontext()
    def synchronize(self, device=None): return None


class DryRun(FakeTensorMode):
    "Fake tensors whose `.item()` gives 1: a reported number has no value here; none is checked."
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1.0 if args[0].dtype.is_floating_point else 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.fixture(scope="module")
def hf():
    "A GPT-2 of 12 heads and 4 blocks, real CPU weights, no dropout, as the trainer builds it."
    if torch._C._get_privateuse1_backend_name() != GPU:
        _setup_privateuseone_for_python_backend(GPU, backend_module=FakeStreams())
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
                if p.device.type == GPU: moved[id(p)] = p  # there already: kept, as torch keeps it
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
        device_mesh = build_mesh(ParallelDims(WORLD, tp=tp, cp=cp, pp=pp))  # its rank tables: real, not fake
        with DryRun(allow_non_fake_inputs=True):
            mesh = Mesh(hf, cfg, device=GPU, device_mesh=device_mesh)
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
    "Every test below, in a fresh interpreter: each layout's dry run and the planted bugs caught."
    proc = run_cli([PY, "-m", "pytest", "-q", "--full", "-p", "no:cacheprovider", __file__],
                   env={"DISTCOURSE_DRY_RUN": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert f"{len(LAYOUTS) + len(STAGES) + 4} passed" in proc.stdout, proc.stdout[-1000:]


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
        written = [*saved["model"].values(), *tensors(saved["optimizer"]["state"])]  # one process's names
        assert {t.device.type for t in written} == {GPU}, (layout, rank)  # the checkpoint's
    want = {"all_reduce"}  # dp's gradient sums, and the loss and token counts
    if pp > 1: want |= {"batch_isend_irecv", "broadcast"}  # activations and their gradients (03a's groups), the loss
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
    fixed = "stage.config.n_embd, device=device)"
    bad = _planted(pipeline, pipeline.pipeline_step, fixed, "stage.config.n_embd)")
    monkeypatch.setattr(mesh_module, "pipeline_step", bad)  # the mesh's step calls it by that name
    with pytest.raises(DeviceError, match=r"dist.batch_isend_irecv was handed a \(2, 16, 96\) tensor on cpu"):
        dry_step(hf, "dp2_tp2_pp2", 2)  # stage 1: it receives stage 0's activations first


class HandDDP(DistributedDataParallel):
    "DDP's contract without its C++ reducer: rank 0's state broadcast, each gradient summed ÷ N."
    def __init__(self, module, **kwargs):  # Accelerate's DDP arguments: buckets, hooks (unused)
        nn.Module.__init__(self)
        self.module, self.require_backward_grad_sync = module, True
        for t in [*module.parameters(), *module.buffers()]: dist.broadcast(t.detach(), 0)
        for p in module.parameters():
            if p.requires_grad: p.register_post_accumulate_grad_hook(self._reduce)

    def _reduce(self, p):  # once per parameter and backward, after its gradient is accumulated
        if not self.require_backward_grad_sync: return
        dist.all_reduce(p.grad)
        p.grad.div_(dist.get_world_size())

    def forward(self, *args, **kwargs): return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        self.require_backward_grad_sync = False
        try: yield
        finally: self.require_backward_grad_sync = True


@pytest.fixture
def written(seen, monkeypatch):
    "What the savers are handed, by file name (dcp: 'sharded'); DDP and FSDP2's mesh made runnable."
    out = {}
    def record(obj, f=None, *args, checkpoint_id=None, **kwargs):  # dcp: checkpoint_id=dir
        out[os.path.basename(str(f or checkpoint_id))] = obj
    monkeypatch.setattr(torch, "save", record)  # Accelerate's pickles and RNG states, --grads_at
    monkeypatch.setattr("accelerate.utils.other.safe_save_file", record)  # the model's weights
    monkeypatch.setattr("torch.distributed.checkpoint.save", record)  # ShardedState at stages 2-3
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", HandDDP)  # Accelerate's
    real_mesh = zero.init_device_mesh
    def device_mesh(*args, **kwargs):  # which rank sits where: real tensors, not fake ones
        with unset_fake_temporarily(): return real_mesh(*args, **kwargs)
    monkeypatch.setattr(zero, "init_device_mesh", device_mesh)
    return out


def trainer_step(hf, layout, rank, out_dir) -> tuple:
    "Rank `rank` of `layout` makes `train`'s calls for a step and a save: (model, opt, sched, ...)."
    stage, zero2 = STAGES[layout]
    cfg = Config(zero_stage=stage, seq_len=T, batch_size=2, grad_accum=2, lr=1e-3, warmup_steps=1,
                 max_steps=4, max_grad_norm=1.0, grads_at=1, output_dir=str(out_dir))
    rows = [{k: torch.randint(0, 128, (T,)) for k in ("input_ids", "labels")}  # CPU on purpose
            for _ in range(WORLD * cfg.batch_size * cfg.grad_accum)]  # one step of every rank
    env = dict(ACCELERATE_TORCH_DEVICE=GPU, RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=WORLD,
               LOCAL_WORLD_SIZE=WORLD, DISTCOURSE_WORLD_SIZE=WORLD)
    dist.init_process_group(f"cpu:fake,{GPU}:fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        fake = DryRun(allow_non_fake_inputs=True)
        with patch_environment(**env), _fresh_accelerate_state(), fake:
            acc, model = make_accelerator(), copy.deepcopy(hf)  # the CPU model `_setup` builds
            loader = DataLoader(rows, batch_size=cfg.batch_size)
            val = DataLoader(rows[:WORLD * cfg.batch_size], batch_size=cfg.batch_size)
            engine = DataParallelEngine(model, cfg, acc)  # the engine `train` makes at these degrees
            if zero2 is None: loader, val, memory = engine.prepare(acc, loader, val)  # as `train` prepares
            else:  # ZeRO-2 by hand, which `train` never builds: prepare's calls with its optimizer
                engine.activation_bytes(first_batch(loader))  # moves the model, as prepare does first
                engine.model, engine.opt, loader, val = zero.prepare_zero(acc, model, stage, cfg.lr, cfg.weight_decay,
                                                                          loaders=(loader, val), zero2=zero2)
                engine.sched = make_scheduler(engine.opt, cfg.warmup_steps, cfg.max_steps)
                memory = track_memory(engine.model, engine.opt)  # filled at the optimizer step
            model, opt, sched, stream = engine.model, engine.opt, engine.sched, DataStream(loader, cfg.seed)
            ((_, res),) = engine.train_steps(stream, 1, 0, cfg.grad_accum, cfg.max_grad_norm,
                                             on_grads=_grads_saver(acc, cfg))
            res["val"] = evaluate_distributed(acc, model, val, "clm")  # gathers every rank's
            res["memory"] = memory
            if zero2 is None: _save(acc, cfg, 1, res["tokens"], stream)
            else: opt.consolidate_state_dict(to=0)  # its own save: the whole state on rank 0
            full = ddp.full_state_dict(acc.unwrap_model(model))  # what `save_model` writes
        return acc.unwrap_model(model), opt, sched, res, full
    finally: dist.destroy_process_group()


def devices(obj) -> set:
    "The device types of the tensors in `obj` (nested dicts, lists), AdamW's step counts left out."
    if isinstance(obj, torch.Tensor): return {obj.device.type}
    if not isinstance(obj, (dict, list)): return set()
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    return set().union(set(), *(devices(v) for k, v in items if k != "step"))


@inner
@pytest.mark.parametrize("layout", STAGES)
def test_trainer_step_keeps_everything_on_the_device(hf, seen, written, layout, tmp_path):
    stage, zero2 = STAGES[layout]
    # Rank 0 only: every rank of a dp-only layout runs the same code, and rank 0 also writes.
    model, opt, sched, res, full = trainer_step(hf, layout, 0, tmp_path)
    assert {p.device.type for p in model.parameters()} == {GPU}, layout
    adam = tensors(_inner(opt).state)
    assert adam and {v.device.type for v in adam} == {GPU}, layout  # AdamW stepped, on the device
    assert sched.last_epoch == 1 and {"loss", "tokens", "grad_norm"} <= res.keys()
    assert res["val"]["samples"] and res["memory"]["optimizer_bytes"], layout  # it ran
    names = {n for n, _ in model.named_parameters()}  # the tied matrix once
    assert full.keys() >= names and devices(full) == {"cpu"}, layout  # the final model, gathered
    # --grads_at: whole gradients, CPU; none from ZeRO-2 by hand, which frees each .grad in backward
    # once its bucket is reduce-scattered (its slices are the gradient: opt.full_grads gathers them)
    assert written["grads_step1.pt"].keys() == (set() if zero2 else names), layout
    if zero2: whole = opt.state_dict()["state"]  # every group's moments, gathered to rank 0
    elif stage >= 2: whole = written["sharded"]  # ShardedState's, for dcp: this rank's shards
    else: whole = written.get("optimizer.bin", written.get("custom_checkpoint_0.pkl"))
    assert whole and devices(whole) == {"cpu" if stage == 1 or zero2 else GPU}, layout
    if not zero2:  # the trainer's checkpoint: every piece handed to a saver, the step complete
        assert {"random_states_0.pkl", "custom_checkpoint_0.pkl"} <= written.keys(), sorted(written)
        assert stage >= 2 or "model.safetensors" in written, sorted(written)
        assert (tmp_path / "checkpoints/step_1/COMPLETE").is_file(), layout
    want = {"all_reduce"} | ({"broadcast"} if stage < 2 else set())  # DDP wraps stages 0-1
    if stage: want |= {"all_gather_single"} | ({"reduce_scatter_single"} if stage >= 2 else set())
    assert want <= seen, f"{layout}: the checked collectives saw {seen}, not {want}"


@inner
def test_a_cpu_buffer_in_zero_fails_the_dry_run(hf, seen, written, monkeypatch, tmp_path):
    "ZeRO's flat buffer made without device=: AdamW steps CPU slices, the all-gather refuses them."
    fixed = "torch.zeros(hi - lo, device=tensors[0].device)"
    bad = _planted(zero, zero._flat_slice, fixed, "torch.zeros(hi - lo)")
    monkeypatch.setattr(zero, "_flat_slice", bad)
    caught = r"dist.all_gather_single was handed a \(\d+,\) tensor on cpu"
    with pytest.raises(DeviceError, match=caught):
        trainer_step(hf, "zero1", 0, tmp_path)


@inner
def test_a_cpu_accumulator_fails_the_trainer_dry_run(hf, seen, written, monkeypatch, tmp_path):
    "The trainer step's loss accumulator made without device=: the CPU sum meets the device's loss."
    fixed = "torch.zeros((), device=accelerator.device)"
    monkeypatch.setattr(ddp, "train_step", _planted(ddp, ddp.train_step, fixed, "torch.zeros(())"))
    with pytest.raises(RuntimeError, match="wrong device, found cpu"):
        trainer_step(hf, "ddp", 0, tmp_path)
