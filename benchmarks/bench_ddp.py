"""`train_step` on 1 process with all the cores vs on 2 processes (gloo) with half the cores each, step by step.

Both runs live at once and take turns, one optimizer step each, told when to go over a socket by `ddp_turns`
(the parent); whoever waits, waits blocked. So both see the same neighbours' load, as the contenders of one
process do. The 2-process run is `torchrun --nproc_per_node 2` on a free port; the 1-process run is plain `python`.

    python benchmarks/bench_ddp.py --port P --threads 2 --bench '{...}'   # a worker; started by ddp_turns
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
GO, STOP = 1, 0


def worker(port, threads, bench: dict):
    "One optimizer step per GO from the parent; rank 0 answers with its seconds, then the all-reduce time on STOP."
    import torch
    import torch.distributed as dist
    sys.path.insert(0, str(HERE))
    from bench_steps import Bench, DistcourseStep, timed
    from distcourse.launch import make_accelerator
    torch.set_num_threads(threads)
    b = Bench(**bench)
    acc = make_accelerator(cpu=True)  # gloo on CPU, on a GPU machine too; verifies the world size torchrun asked for
    step = DistcourseStep(replace(b, batch_size=b.batch_size // acc.num_processes), acc)
    conn = socket.create_connection(("127.0.0.1", port)) if acc.is_main_process else None
    lines = conn.makefile("r") if conn else None
    if conn: conn.sendall(f"{acc.num_processes}\n".encode())
    while True:
        cmd = torch.tensor([GO if lines is None or lines.readline().strip() == "go" else STOP])
        if acc.num_processes > 1: dist.broadcast(cmd, src=0)  # rank 1 waits here (blocked) for rank 0's word
        if cmd.item() == STOP: break
        seconds, tokens = timed(step, 1, "cpu")
        if conn: conn.sendall(f"{seconds} {tokens}\n".encode())
    comm = []  # what DDP adds to a step: one all-reduce of every gradient (timed alone)
    if acc.num_processes > 1:
        grads = torch.zeros(sum(p.numel() for p in step.model.parameters()))
        for _ in range(3):
            dist.barrier(); t0 = time.perf_counter(); dist.all_reduce(grads); comm.append(time.perf_counter() - t0)
    if conn: conn.sendall((json.dumps({"allreduce_s": comm, "allreduce_bytes": 4 * len(grads) if comm else 0,
                                       "threads": torch.get_num_threads(),
                                       "distributed_type": acc.distributed_type.value}) + "\n").encode())
    acc.free_memory(); del step  # free DDP's reducer while the group is alive (else exit can hang in gloo)
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


def ddp_turns(b, cores, timeout=600) -> dict:
    "Per-step seconds of the 1-process and the 2-process run of `b` (global batch `b.batch_size`), taking turns."
    from distcourse.launch import free_port
    server = socket.create_server(("127.0.0.1", 0))
    port, procs, deadline = server.getsockname()[1], {}, time.time() + timeout
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_USE_CPU": "true"}
    try:
        for world in (1, 2):
            threads = max(1, cores // world)
            args = [str(HERE / "bench_ddp.py"), "--port", str(port), "--threads", str(threads), "--bench", json.dumps(asdict(b))]
            launcher = [] if world == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", "2",
                                              "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
            procs[world] = subprocess.Popen([sys.executable, *launcher, *args], start_new_session=True,
                                            env={**env, "OMP_NUM_THREADS": str(threads)})
        conns = {}
        for _ in procs:
            c = _accept(server, procs.values(), deadline); c.settimeout(timeout)
            f = c.makefile("r"); conns[int(_reply(f))] = (c, f)
        times = {1: [], 2: []}
        for turn in range(b.warmup + b.steps):
            for world in ((1, 2) if turn % 2 == 0 else (2, 1)):
                c, f = conns[world]; c.sendall(b"go\n")
                seconds, tokens = _reply(f).split()
                times[world].append((float(seconds), float(tokens)))
        info = {}
        for world, (c, f) in conns.items(): c.sendall(b"stop\n"); info[world] = json.loads(_reply(f))
        _wait(procs.values(), 60)  # the results are in; a worker stuck on its way out is stopped below
    finally:
        for p in procs.values():  # torchrun passes SIGTERM on to its workers (they run in sessions of their own)
            if p.poll() is None: p.terminate()
        for p in _wait(procs.values(), 30): os.killpg(p.pid, signal.SIGKILL); p.wait()
        server.close()
    return {w: {"step_s": [s for s, _ in t[b.warmup:]], "tokens_per_step": t[-1][1], **info[w]} for w, t in times.items()}


def summarize(runs, b, cores) -> dict:
    "ddp2_efficiency (median over turns of the 2-process ÷ 1-process tokens/s), with what a step spends on the all-reduce."
    tps = {w: r["tokens_per_step"] / statistics.median(r["step_s"]) for w, r in runs.items()}
    paired = [(runs[2]["tokens_per_step"] / s2) / (runs[1]["tokens_per_step"] / s1)
              for s1, s2 in zip(runs[1]["step_s"], runs[2]["step_s"])]
    allreduce = statistics.median(runs[2]["allreduce_s"])
    return {"ddp2_efficiency": statistics.median(paired), "ratio_of_medians": tps[2] / tps[1],
            "paired_iqr": statistics.quantiles(paired, n=4)[::2] if len(paired) > 1 else paired * 2,
            "tokens_per_s": {f"1x{runs[1]['threads']}": tps[1], f"2x{runs[2]['threads']}": tps[2]},
            "step_s": {str(w): r["step_s"] for w, r in runs.items()},
            "allreduce_s": allreduce, "allreduce_bytes": runs[2]["allreduce_bytes"],
            "allreduce_share": allreduce / statistics.median(runs[2]["step_s"]),
            "distributed_type": {str(w): r["distributed_type"] for w, r in runs.items()}, "bench": asdict(b),
            "compared": f"1 process x {runs[1]['threads']} threads, batch {b.batch_size} vs 2 processes x "
                        f"{runs[2]['threads']} threads, batch {b.batch_size // 2} each (the same global batch), "
                        f"gloo, {cores} cores"}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True); p.add_argument("--threads", type=int, required=True)
    p.add_argument("--bench", required=True)
    a = p.parse_args()
    worker(a.port, a.threads, json.loads(a.bench))
