"""`train_step` on 1 process and on 2 processes (gloo), step by step, in two comparisons:

- processes vs threads on the same cores: 1 process on all the cores against 2 processes on half the cores each,
  the same global batch (`processes_vs_threads`; the hardware does not change, so this is not scaling);
- scaling with twice the hardware: 1 process pinned to one half of the cores (one core on a 2-core machine)
  against the 2 processes, each pinned to its own half: weak scaling at the 2-process run's batch per process,
  strong scaling at its global batch (`scaling.py` holds the formulas).

Every run lives at once and they take turns, one optimizer step each, told when to go over a socket by
`ddp_turns` (the parent); whoever waits, waits blocked. So all see the same neighbours' load, as the contenders of
one process do. The 2-process run is `torchrun --nproc_per_node 2` on a free port; the others are plain `python`.

    python benchmarks/bench_ddp.py --port P --names 1x1,1x1_half_batch --threads 1 --batches 8,4 --pin --bench '{...}'
    # a worker (one process, two batches), started by ddp_turns
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from scaling import Run, strong_scaling_efficiency, weak_scaling_efficiency  # noqa: E402

GO, STOP = 1, 0


def worker(port, names, threads, batches, bench: dict, pin=False):
    "One step at batches[i] per `go i` from the parent; rank 0 answers with its seconds (on `stop`: the all-reduce)."
    if pin:  # rank r on the r-th `threads` of the cores: each process its own share of the hardware
        rank, mine = int(os.getenv("LOCAL_RANK", "0")), sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, mine[rank * threads:(rank + 1) * threads])
    import torch
    import torch.distributed as dist
    sys.path.insert(0, str(HERE))
    from bench_steps import Bench, DistcourseStep, timed
    from distcourse.launch import make_accelerator
    torch.set_num_threads(threads)
    b = Bench(**bench)
    acc = make_accelerator(cpu=True)  # gloo on CPU, on a GPU machine too; verifies the world size torchrun asked for
    steps = [DistcourseStep(replace(b, batch_size=n), acc) for n in batches]  # n sequences per process
    conn = socket.create_connection(("127.0.0.1", port)) if acc.is_main_process else None
    lines = conn.makefile("r") if conn else None
    if conn: conn.sendall(f"{names}\n".encode())
    while True:
        word = lines.readline().split() if lines else []
        cmd = torch.tensor([STOP if word[:1] == ["stop"] else GO + (int(word[1]) if word else 0)])
        if acc.num_processes > 1: dist.broadcast(cmd, src=0)  # rank 1 waits here (blocked) for rank 0's word
        if cmd.item() == STOP: break
        seconds, tokens = timed(steps[cmd.item() - GO], 1, "cpu")
        if conn: conn.sendall(f"{seconds} {tokens}\n".encode())
    comm = []  # what DDP adds to a step: one all-reduce of every gradient (timed alone)
    if acc.num_processes > 1:
        grads = torch.zeros(sum(p.numel() for p in steps[0].model.parameters()))
        for _ in range(3):
            dist.barrier(); t0 = time.perf_counter(); dist.all_reduce(grads); comm.append(time.perf_counter() - t0)
    if conn: conn.sendall((json.dumps({"allreduce_s": comm, "allreduce_bytes": 4 * len(grads) if comm else 0,
                                       "threads": torch.get_num_threads(), "processes": acc.num_processes,
                                       "batches": batches, "pinned": pin,
                                       "cores": len(os.sched_getaffinity(0)),
                                       "distributed_type": acc.distributed_type.value}) + "\n").encode())
    acc.free_memory(); del steps  # free DDP's reducer while the group is alive (else exit can hang in gloo)
    acc.wait_for_everyone(); acc.end_training()  # leave the process group together


def _accept(server, procs, deadline):
    "The next connection to `server`; raises if a worker exits first or `deadline` passes."
    server.settimeout(1.0)
    while time.time() < deadline:
        try: return server.accept()[0]
        except TimeoutError:
            if any(p.poll() is not None for p in procs): break
    raise RuntimeError(f"ddp workers did not connect (exit codes {[p.poll() for p in procs]}); see their output above")


def _wait(procs, seconds) -> list:
    "Wait up to `seconds` in all for `procs` to exit; the ones still running."
    deadline = time.time() + seconds
    for p in procs:
        try: p.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired: pass
    return [p for p in procs if p.poll() is None]


def _reply(f) -> str:
    line = f.readline()
    if not line: raise RuntimeError("a ddp worker closed its connection (it failed; see its output above)")
    return line


def runs_of(b, cores) -> dict:
    "(processes, threads each, pinned) -> {run name: batch per process}: what `ddp_turns` measures side by side."
    half = max(1, cores // 2)  # "a device" of the scaling comparison: half the cores (one core on 2 cores)
    runs = {(1, cores, False): {"1x2": b.batch_size},           # 1 process on all the cores
            (2, half, cores >= 2): {"2x1": b.batch_size // 2}}  # 2 processes on half each: the same global batch
    if cores >= 2:  # twice the hardware exists: the 2-process run against 1 process on half the cores
        runs[(1, half, True)] = {"1x1": b.batch_size,                # strong: the same global batch
                                 "1x1_half_batch": b.batch_size // 2}  # weak: the same batch per process
    return runs  # one process runs both 1x1 batches: one start-up less


def ddp_turns(b, cores, timeout=600) -> dict:
    "Per-step seconds of each of `runs_of(b, cores)` (global batch `b.batch_size` or half of it), taking turns."
    from distcourse.launch import free_port
    server = socket.create_server(("127.0.0.1", 0))
    port, procs, deadline = server.getsockname()[1], {}, time.time() + timeout
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_USE_CPU": "true"}
    spec = runs_of(b, cores)
    order = [name for batches in spec.values() for name in batches]
    try:
        for (world, threads, pin), batches in spec.items():
            name = ",".join(batches)
            args = [str(HERE / "bench_ddp.py"), "--port", str(port), "--names", name, "--threads", str(threads),
                    "--batches", ",".join(map(str, batches.values())), "--bench", json.dumps(asdict(b)),
                    *(["--pin"] if pin else [])]
            launcher = [] if world == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(world),
                                              "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
            procs[name] = subprocess.Popen([sys.executable, *launcher, *args], start_new_session=True,
                                           env={**env, "OMP_NUM_THREADS": str(threads)})
        conns = {}  # run name -> (socket, its reader, the index of the run's batch in its process)
        for _ in procs:
            c = _accept(server, procs.values(), deadline); c.settimeout(timeout)
            f = c.makefile("r")
            conns |= {name: (c, f, i) for i, name in enumerate(_reply(f).strip().split(","))}
        times = {name: [] for name in order}
        for turn in range(b.warmup + b.steps):
            for name in (order if turn % 2 == 0 else order[::-1]):
                c, f, i = conns[name]; c.sendall(f"go {i}\n".encode())
                seconds, tokens = _reply(f).split()
                times[name].append((float(seconds), float(tokens)))
        info = {}
        for names in procs:
            c, f, _ = conns[names.split(",")[0]]; c.sendall(b"stop\n"); said = json.loads(_reply(f))
            for name, batch in zip(names.split(","), said.pop("batches")):
                info[name] = said | {"batch_per_process": batch}
        _wait(procs.values(), 60)  # the results are in; a worker stuck on its way out is stopped below
    finally:
        for p in procs.values():  # torchrun passes SIGTERM on to its workers (they run in sessions of their own)
            if p.poll() is None: p.terminate()
        for p in _wait(procs.values(), 30): os.killpg(p.pid, signal.SIGKILL); p.wait()
        server.close()
    return {name: {"step_s": [s for s, _ in t[b.warmup:]], "tokens_per_step": t[-1][1], **info[name]}
            for name, t in times.items()}


def described(r) -> str:
    "A run in words: processes, threads, batch, pinning."
    each = " each" if r["processes"] > 1 else ""
    cores = f" pinned to {r['cores']} core{'s' * (r['cores'] > 1)}{each}" if r["pinned"] else ""
    return (f"{r['processes']} process{'es' * (r['processes'] > 1)} x {r['threads']} thread"
            f"{'s' * (r['threads'] > 1)}{cores}, batch {r['batch_per_process']} per process")


def summarize(runs, b, cores) -> dict:
    "processes_vs_threads (2 processes ÷ 1 on the same cores), weak and strong scaling where there are 2 cores or more."
    tps = {k: r["tokens_per_step"] / statistics.median(r["step_s"]) for k, r in runs.items()}
    paired = [(runs["2x1"]["tokens_per_step"] / s2) / (runs["1x2"]["tokens_per_step"] / s1)
              for s1, s2 in zip(runs["1x2"]["step_s"], runs["2x1"]["step_s"])]
    allreduce = statistics.median(runs["2x1"]["allreduce_s"])
    out = {"processes_vs_threads": statistics.median(paired), "ratio_of_medians": tps["2x1"] / tps["1x2"],
           "paired_iqr": statistics.quantiles(paired, n=4)[::2] if len(paired) > 1 else paired * 2,
           "tokens_per_s": {described(runs[k]): v for k, v in tps.items()},
           "step_s": {k: r["step_s"] for k, r in runs.items()},
           "allreduce_s": allreduce, "allreduce_bytes": runs["2x1"]["allreduce_bytes"],
           "allreduce_share": allreduce / statistics.median(runs["2x1"]["step_s"]),
           "distributed_type": {k: r["distributed_type"] for k, r in runs.items()}, "bench": asdict(b),
           "compared": f"processes vs threads on the same {cores} cores (not scaling: the hardware is the same): "
                       f"{described(runs['2x1'])} vs {described(runs['1x2'])} (the same global batch {b.batch_size}),"
                       " gloo", "weak_scaling": None, "strong_scaling": None}
    if "1x1" in runs:  # a 1-process run on one process's share of the cores: 2 processes have twice its hardware
        device = "core" if runs["2x1"]["cores"] == 1 else f"{runs['2x1']['cores']}-core share"
        def run(k): return Run(devices=runs[k]["processes"], batch_per_device=runs[k]["batch_per_process"],
                               tokens_per_s=tps[k], step_s=statistics.median(runs[k]["step_s"]), device=device)
        out["weak_scaling"] = weak_scaling_efficiency(run("1x1_half_batch"), run("2x1"))
        out["strong_scaling"] = strong_scaling_efficiency(run("1x1"), run("2x1"))
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True); p.add_argument("--names", required=True)
    p.add_argument("--threads", type=int, required=True); p.add_argument("--batches", required=True)
    p.add_argument("--bench", required=True); p.add_argument("--pin", action="store_true")
    a = p.parse_args()
    worker(a.port, a.names, a.threads, [int(n) for n in a.batches.split(",")], json.loads(a.bench), a.pin)
