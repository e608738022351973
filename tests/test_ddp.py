"""`distcourse.ddp` with real processes (2 on CPU, gloo): gradients by hand = DDP = one process, and
1 × 8 = 2 × 4 = 1 × 4 × 2 step for step."""
import json
from functools import partial
from itertools import islice
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from conftest import grads_diff, worst_rel

from distcourse.ddp import grads_by_hand, grads_ddp, train_step, train_worker
from distcourse.loop import setup
from distcourse.launch import launch, make_accelerator
from distcourse.loop import epochs, loss_sum, make_optimizer, make_scheduler

CPU = {"ACCELERATE_USE_CPU": "true"}  # gloo on CPU, on machines with a GPU too
STEPS = 5
TASKS = ["clm", "cls"]  # cls: variable-length examples, each micro-batch padded to its own longest


def flat(d):
    return torch.cat([v.detach().double().flatten() for k, v in sorted(d.items()) if v.is_floating_point()])


def rel_diff(a, b) -> float:
    "‖a - b‖ / ‖a‖ with all tensors of each dict as one vector."
    return ((flat(a) - flat(b)).norm() / flat(a).norm()).item()


def one_process_grads(task):
    "Gradient of the mean loss over the 8 examples the two ranks draw, in this process."
    model, train_dl, _ = setup(task)
    ds = train_dl.dataset
    idx = [i for r in range(2) for i in islice(DistributedSampler(ds, num_replicas=2, rank=r, seed=0), 4)]
    s, n = loss_sum(model, train_dl.collate_fn([ds[i] for i in idx]), task)
    (s / n).backward()
    return {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("task", TASKS)
def test_gradients_by_hand_and_ddp_equal_one_process(task, tmp_path):
    launch(grads_by_hand, (tmp_path, task), num_processes=2, **CPU)
    launch(grads_ddp, (tmp_path, task), num_processes=2, **CPU)
    ref = one_process_grads(task)
    hand = [torch.load(tmp_path / f"by_hand_rank{r}.pt") for r in (0, 1)]
    ddp = [torch.load(tmp_path / f"ddp_rank{r}.pt") for r in (0, 1)]
    assert rel_diff(hand[0], hand[1]) == 0 and rel_diff(ddp[0], ddp[1]) == 0  # identical on the two ranks
    for got in (hand[0], ddp[0]):
        assert got.keys() == ref.keys()
        assert grads_diff(ref, got) < 1e-5  # each tensor against its own norm
        assert all(torch.allclose(ref[k], got[k], rtol=1e-4, atol=1e-8) for k in ref)


CONFIGS = {"1x8": dict(num_processes=1, batch_size=8),
           "2x4": dict(num_processes=2, batch_size=4),
           "1x4x2": dict(num_processes=1, batch_size=4, grad_accum=2),
           "1x4x2 G=2": dict(num_processes=1, batch_size=4, grad_accum=2,
                             accelerator_kwargs={"gradient_accumulation_steps": 2})}


@pytest.fixture(scope="module", params=TASKS)
def runs(request, tmp_path_factory):
    "The same seeded training, split four ways; rank 0's history and final weights for each."
    task, out = request.param, {}
    for name, cfg in CONFIGS.items():
        cfg = dict(cfg)
        n, d = cfg.pop("num_processes"), tmp_path_factory.mktemp(f"{request.param}_{name.replace(' ', '_')}")
        launch(partial(train_worker, steps=STEPS, **cfg), (d, task), num_processes=n, **CPU)
        out[name] = (json.loads((d / "history.json").read_text()), torch.load(d / "weights.pt"),
                     torch.load(d / "grads_step1.pt"))
    return task, out


def test_runs_are_what_they_claim(runs):
    _, out = runs
    assert [out[k][0]["world"] for k in CONFIGS] == [1, 2, 1, 1]
    for hist, *_ in out.values():
        assert len(hist["train"]) == STEPS
        assert hist["val"]["samples"] == hist["val_size"]  # gather_for_metrics: each example once


def test_same_losses_tokens_and_schedule(runs):
    _, out = runs
    ref = out["1x8"][0]["train"]
    for name, (hist, *_) in out.items():
        assert [r["tokens"] for r in hist["train"]] == [r["tokens"] for r in ref], name
        assert [r["lr"] for r in hist["train"]] == [r["lr"] for r in ref], name
        worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(hist["train"], ref))
        assert worst <= 1e-5, (name, worst)


def test_same_gradients(runs):
    "Every step's pre-clip gradient norm and step 1's gradients (AdamW hides a factor on them)."
    task, out = runs
    ref, ref_grads = out["1x8"][0]["train"], out["1x8"][2]
    for name, (hist, _, grads) in out.items():
        norms = worst_rel([r["grad_norm"] for r in ref], [r["grad_norm"] for r in hist["train"]])
        first = grads_diff(ref_grads, grads)
        print(f"{task} {name}: worst relative gradient norm {norms:.1e}, step 1's gradients "
              f"{first:.1e}")
        assert norms <= 1e-5 and first <= 1e-5, (name, norms, first)  # measured: 1.1e-7, 5.3e-8


def test_same_final_weights(runs):
    task, out = runs
    init = setup(task)[0].state_dict()
    w0 = out["1x8"][1]
    update = {k: w0[k] - init[k] for k in w0 if w0[k].is_floating_point()}
    assert flat(update).norm() > 0  # training moved the weights
    for name, (_, w, _) in out.items():
        assert rel_diff(w0, w) <= 1e-5, name
        assert rel_diff(update, {k: w[k] - init[k] for k in update}) <= 1e-5, name  # relative to the change


def _prepared_scheduler_steps(out_dir):
    "2 processes, default Accelerator (the scheduler would step twice per call): train_step steps it once."
    acc = make_accelerator()
    model, train_dl, _ = setup("cls", batch_size=4)
    opt = make_optimizer(model, 1e-3)
    model, opt, train_dl, sched = acc.prepare(model, opt, train_dl, make_scheduler(opt, 2, 10))
    batches = epochs(train_dl)
    for _ in range(3): train_step(acc, model, opt, sched, [next(batches)], "cls")
    if acc.is_main_process: Path(out_dir, "steps.json").write_text(json.dumps(sched.scheduler.last_epoch))


def test_prepared_scheduler_steps_once_per_step(tmp_path):
    launch(_prepared_scheduler_steps, (tmp_path,), num_processes=2, **CPU)
    assert json.loads((tmp_path / "steps.json").read_text()) == 3


def buckets_worker(out):
    "Worker: tensors of three dtypes and several shapes summed per tensor, and by all_reduce_buckets at each cap."
    import torch.distributed as dist
    from distcourse.ddp import all_reduce_buckets
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    made = [torch.randn(5, 3, generator=g), torch.randn((), generator=g).double(), torch.randn(7, generator=g),
            torch.randint(0, 9, (4,), generator=g), torch.randn(2, 2, 2, generator=g), torch.randn(1, generator=g)]
    want = [t.clone() for t in made]
    for t in want: dist.all_reduce(t)
    res = {"alone": all_reduce_buckets([t.clone() for t in made], group=dist.new_group([rank]))}
    for cap in (1, 80, 2**30):
        mine = [t.clone() for t in made]
        res[cap] = (all_reduce_buckets(mine, cap_bytes=cap), all(torch.equal(a, b) for a, b in zip(mine, want)))
    if rank == 0: torch.save(res, out / "buckets.pt")
    dist.barrier(); dist.destroy_process_group()


@pytest.mark.fast
def test_all_reduce_buckets_sums_as_one_call_per_bucket(tmp_path):
    """DDP's buckets by hand: every sum equals the per-tensor all-reduce bit for bit (2 ranks), one call per bucket;
    a bucket closes once it holds at least its cap, never mixes dtypes, and a group of one makes no call."""
    launch(buckets_worker, (tmp_path,), num_processes=2, timeout=120, **CPU)
    res = torch.load(tmp_path / "buckets.pt")
    assert res.pop("alone") == 0
    # float32 (60, 28, 32, 4 bytes), float64 (8), int64 (32): cap 1 closes every bucket after one tensor; at 80
    # bytes float32's close after 60 + 28, then 32 + 4; a large cap leaves one bucket per dtype
    assert res == {1: (6, True), 80: (4, True), 2**30: (3, True)}, res


class _Tied(torch.nn.Module):
    "An embedding, a layer, a frozen layer and an output layer tied to the embedding."
    def __init__(self, vocab=32, width=16):
        super().__init__()
        self.emb, self.body = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, width)
        self.frozen = torch.nn.Linear(width, width).requires_grad_(False)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x): return self.head(self.frozen(torch.tanh(self.body(self.emb(x)))))


def wrapper_worker(out, fault=None):
    "Rank 0 writes each step's gradients under DataParallel and DDP (x N), 2 SGD steps of 2 micro-batches."
    from distcourse.ddp import DataParallel, Reducer
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if fault == "early":  # launch a bucket when its first gradient is ready, not its last
        def early(self, p):
            i = self.bucket_of[p]
            if self.sync and i not in self.works: self._launch(i)
        Reducer._ready = early
    torch.manual_seed(rank)  # every rank its own weights: the wrap must broadcast rank 0's
    ours, theirs = _Tied(), _Tied()
    theirs.load_state_dict(ours.state_dict()); theirs.head.weight = theirs.emb.weight
    if fault == "no broadcast": dist.broadcast, real = (lambda *a, **k: None), dist.broadcast
    dp = DataParallel(ours, cap_mb=1e-3, first_mb=1e-3)  # a bucket per tensor or two
    if fault == "no broadcast": dist.broadcast = real
    ddp = torch.nn.parallel.DistributedDataParallel(theirs)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5) for m in (ours, theirs)]
    g, res = torch.Generator().manual_seed(10 + rank), {"grads": [], "buckets": len(dp.reducer.buckets)}
    for _ in range(2):
        xs = [torch.randint(0, 32, (3, 5), generator=g) for _ in range(2)]
        for model, scale in ((dp, 1.0), (ddp, world)):
            with model.no_sync(): model(xs[0]).logsumexp(-1).mean().mul(scale).backward()
            model(xs[1]).logsumexp(-1).mean().mul(scale).backward()
        res["calls"] = dp.finish_gradient_synchronization()
        res["grads"].append([{n: p.grad if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}
                             for m in (ours, theirs)])
        for opt in opts: opt.step(); opt.zero_grad(set_to_none=True)
    if rank == 0: torch.save(res, out / "wrapper.pt")
    del ddp, model  # DDP (the loop's `model` holds it too) goes while its group lives, not as the function returns
    dist.barrier(); dist.destroy_process_group()


def _wrapper_worst(tmp_path, fault=None) -> tuple:
    launch(wrapper_worker, (tmp_path, fault), num_processes=2, timeout=120, **CPU)
    res = torch.load(tmp_path / "wrapper.pt")
    worst = 0.0
    for mine, ddp in res["grads"]:
        assert mine["frozen.weight"] is None and ddp["frozen.weight"] is None
        assert mine.keys() == ddp.keys() and "head.weight" not in mine  # the tied tensor: under its first name
        worst = max(worst, *(((mine[n] - ddp[n]).norm() / ddp[n].norm()).item() for n in mine if mine[n] is not None))
    return worst, res


@pytest.mark.fast
def test_data_parallel_wrapper_equals_ddp(tmp_path):
    """Lesson 03's DataParallel: rank 0's weights broadcast at wrap, each bucket all-reduced from backward hooks,
    no_sync for accumulation, a frozen parameter left alone and a tied one synced once: every gradient of two
    steps equals DDP's (x N, DDP averages), one call per bucket."""
    worst, res = _wrapper_worst(tmp_path)
    assert worst < 1e-6, worst
    assert res["calls"] == res["buckets"] == 2  # body (bias, weight); the embedding (tied)


@pytest.mark.fast
@pytest.mark.parametrize("fault", ["early", "no broadcast"])
def test_data_parallel_wrapper_faults_caught(tmp_path, fault):
    "A bucket sent before its last gradient is in, or replicas left with their own weights: the comparison fails."
    worst, _ = _wrapper_worst(tmp_path, fault)
    assert worst > 1e-3, (fault, worst)
