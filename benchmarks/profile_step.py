"""Where a training step's time goes: the course's step beside the hand-written loop, timed and profiled.

    python benchmarks/profile_step.py              # small model, batch 8 x 128: 30 turns, then one profiled step each
    python benchmarks/profile_step.py --batch_size 16 --turns 20

Three contenders take turns step by step: `torch` (the loop of bench_steps.py), `distcourse` (`train_step`) and
`distcourse, before`: `train_step` with `loss_sum` as lesson 02 first wrote it (slicing the (B, T, V) logits
instead of shifting the labels, and GPT-2 filling its KV cache), kept here to measure the fix. Then
torch.profiler lists, for one step of each, the ops that read or write a logits-sized tensor and the number of
`aten::cat` calls (the KV cache is two per layer); last, the AdamW step alone is timed for torch's three
implementations. For a Python-level view: `py-spy record -o step.svg -- python
benchmarks/profile_step.py`.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"): os.environ.setdefault(k, "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import distcourse.ddp  # noqa: E402
from bench_steps import Bench, DistcourseStep, TorchLoop, timed  # noqa: E402
from distcourse.launch import make_accelerator  # noqa: E402
from distcourse.loop import count_targets  # noqa: E402


def sliced_loss_sum(model, batch, task):
    "`loss_sum` before the fix: the logits sliced to (B, T-1, V), which flattening copies; GPT-2's KV cache on."
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    labels = batch["labels"]
    if task == "clm": logits, labels = logits[:, :-1], labels[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                           ignore_index=-100, reduction="sum")
    return loss, count_targets(batch, task)


class SlicedStep(DistcourseStep):
    "`train_step` with `sliced_loss_sum`."
    name = "distcourse, before"

    def step(self):
        fixed, distcourse.ddp.loss_sum = distcourse.ddp.loss_sum, sliced_loss_sum
        try: return super().step()
        finally: distcourse.ddp.loss_sum = fixed


def logits_ops(contender, shape) -> dict:
    "{op: calls} of one profiled step for the ops with a (B, *, V) input (logits, sliced logits); and aten::cat."
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof: contender.step()
    calls = {}
    for e in prof.events():
        if e.name == "aten::cat" or any(len(s) == 3 and s[0] == shape[0] and s[-1] == shape[-1] for s in e.input_shapes):
            calls[e.name] = calls.get(e.name, 0) + 1
    return calls


def adamw_ms(model, reps=10) -> dict:
    "Median ms of one AdamW step over `model`'s parameters, for each of torch's implementations, taking turns."
    for q in model.parameters(): q.grad = torch.randn_like(q)
    opts = {k: torch.optim.AdamW(model.parameters(), lr=1e-9, **kw)
            for k, kw in (("for-loop", dict(foreach=False)), ("foreach", dict(foreach=True)), ("fused", dict(fused=True)))}
    ms = {k: [] for k in opts}
    for _ in range(reps):
        for k, o in opts.items():
            t0 = time.perf_counter(); o.step(); ms[k].append((time.perf_counter() - t0) * 1e3)
    return {k: round(statistics.median(v), 2) for k, v in ms.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small"); p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=128); p.add_argument("--turns", type=int, default=30)
    a = p.parse_args(argv)
    torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    b = Bench(a.model, a.batch_size, a.seq_len, steps=a.turns + 4)
    acc = make_accelerator()
    runs = [TorchLoop(b), DistcourseStep(b, acc), SlicedStep(b, acc)]
    for c in runs: timed(c, 2, "cpu")  # warm-up
    secs = {c.name: [] for c in runs}
    for turn in range(a.turns):
        for c in (runs if turn % 2 == 0 else runs[::-1]): secs[c.name].append(timed(c, 1, "cpu")[0])
    print(f"{a.model}, batch {a.batch_size} x {a.seq_len}, {torch.get_num_threads()} threads, {a.turns} turns, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'contender':<28}{'median ms':>10}{'min ms':>8}{'÷ torch (paired median, IQR)':>34}")
    for k, v in secs.items():
        paired = [x / t for x, t in zip(v, secs["torch"])]
        lo, hi = statistics.quantiles(paired, n=4)[::2]
        print(f"{k:<28}{statistics.median(v) * 1e3:>10.1f}{min(v) * 1e3:>8.1f}"
              f"{statistics.median(paired):>16.3f} [{lo:.3f}, {hi:.3f}]")
    V = runs[0].model.config.vocab_size
    print(f"\nops on a logits-sized tensor (B={a.batch_size}, T or T-1, V={V}), and all aten::cat, in one step:")
    for c in runs: print(f"  {c.name:<28}", logits_ops(c, (a.batch_size, a.seq_len, V)))
    print("\nAdamW step alone, ms (torch's default on CPU is the for-loop):", adamw_ms(runs[0].model))


if __name__ == "__main__": main()
