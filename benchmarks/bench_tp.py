"""Tensor parallelism on this machine: tokens/s of the course's GPT at tp 1 and tp 2 (the same model and batch),
and how much of a tp-2 step its all-reduces take (lesson 05c's layers, timed where they call `all_reduce_`).

tp 1 is one process with every core; tp 2 is two gloo processes with half the cores each, run after it. There is
no target on a CPU: two processes on two cores share the cores and the memory bandwidth, and each all-reduce waits
for the slower rank, so the time counted as communication includes that wait. It is a measurement to explain.

    python benchmarks/bench_tp.py            # the quick sizes, printed as JSON
"""
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import distcourse.tensor_parallel as tpm
from distcourse.gpt import GPT, GPTConfig
from distcourse.launch import cores, launch

SIZES = {"smoke": dict(model=dict(vocab_size=512, n_positions=32, n_layer=2, n_head=2, n_embd=64),
                       batch_size=4, seq_len=32, warmup=1, steps=3),
         "quick": dict(model=dict(vocab_size=8192, n_positions=128, n_layer=6, n_head=4, n_embd=256),
                       batch_size=8, seq_len=128, warmup=2, steps=10)}


def _step_times(model, size, timed_comm):
    "Per measured step: (seconds, seconds inside all-reduces); AdamW on the model's parameters."
    g = torch.Generator().manual_seed(0)
    x = torch.randint(size["model"]["vocab_size"], (size["batch_size"], size["seq_len"] + 1), generator=g)
    opt, out = torch.optim.AdamW(model.parameters(), lr=1e-3), []
    for i in range(size["warmup"] + size["steps"]):
        timed_comm[0], t0 = 0.0, time.perf_counter()
        _, loss = model(x[:, :-1], targets=x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i >= size["warmup"]: out.append((time.perf_counter() - t0, timed_comm[0]))
    return out


def tp_worker(out_dir, size):
    "Worker: this rank's tensor-parallel GPT; rank 0 writes its step times and its all-reduce times and count."
    dist.init_process_group("gloo")
    comm, calls, plain = [0.0], [0], tpm.all_reduce_
    def timed(t, group, direction, log=None):
        t0 = time.perf_counter()
        out = plain(t, group, direction, log)
        comm[0] += time.perf_counter() - t0
        calls[0] += 1
        return out
    tpm.all_reduce_ = timed  # the parallel layers look it up in their module at every call
    torch.manual_seed(0)
    model = tpm.tensor_parallel(GPT(GPTConfig(**size["model"])))
    times = _step_times(model, size, comm)
    if dist.get_rank() == 0:
        Path(out_dir, "tp.json").write_text(json.dumps({"times": times, "threads": torch.get_num_threads(),
                                                        "all_reduces": calls[0]}))
    tpm.all_reduce_ = plain


def measure_tp(mode="quick") -> dict:
    "tokens/s at tp 1 (here, every core) and tp 2 (2 processes), and the share of a tp-2 step in all-reduces."
    size = SIZES[mode]
    tokens = size["batch_size"] * size["seq_len"]
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(cores())
    one = _step_times(GPT(GPTConfig(**size["model"])), size, [0.0])
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as d:
        launch(tp_worker, (d, size), num_processes=2, timeout=600)
        two = json.loads(Path(d, "tp.json").read_text())
    step1 = statistics.median(s for s, _ in one)
    step2 = statistics.median(s for s, _ in two["times"])
    comm = statistics.median(c / s for s, c in two["times"])
    n_layer = size["model"]["n_layer"]
    return {"size": size, "tokens_per_s": {"tp1": tokens / step1, "tp2": tokens / step2},
            "tp2_vs_tp1": step1 / step2, "tp2_comm_fraction": comm,
            "all_reduces_per_step": two["all_reduces"] / (size["warmup"] + size["steps"]),
            "all_reduces_predicted": 4 * n_layer,  # per block: 2 forward (g after attention and MLP), 2 backward (f)
            "threads": {"tp1": cores(), "tp2": two["threads"]}}


if __name__ == "__main__":
    print(json.dumps(measure_tp(sys.argv[1] if len(sys.argv) > 1 else "quick"), indent=1))
