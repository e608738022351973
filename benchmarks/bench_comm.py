"""Latency and bus bandwidth of the collectives, on N gloo processes of this machine, by message size.

    python benchmarks/bench_comm.py --world 2 4 --max_mib 64     # the table and benchmarks/comm.json

Bandwidths follow nccl-tests (PERFORMANCE.md there): algbw = bytes ÷ seconds, with bytes the size of the whole
buffer (all_gather: the gathered output; reduce_scatter: the input), and busbw = algbw × a factor that makes
busbw comparable with the link's speed whatever the collective: 2(n−1)/n for all_reduce, (n−1)/n for
all_gather, reduce_scatter and all_to_all, 1 for broadcast and send/recv. Each point is the median of
`repeats` timed calls after one warm-up, every call started together (a barrier before it).
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")


def bus_factor(collective, n) -> float:
    "nccl-tests' busbw ÷ algbw for `collective` on `n` ranks."
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0, "send_recv": 1.0}.get(collective, (n - 1) / n)


def _op(collective, numel, rank, n):
    "A function that runs one `collective` on a buffer of `numel` fp32 values (its whole size, as nccl-tests counts)."
    x = torch.ones(numel)
    if collective == "all_reduce": return lambda: dist.all_reduce(x)
    if collective == "broadcast": return lambda: dist.broadcast(x, src=0)
    if collective == "all_gather":
        part = torch.ones(numel // n)
        return lambda: dist.all_gather_single(x, part)
    if collective == "reduce_scatter":
        part = torch.empty(numel // n)
        return lambda: dist.reduce_scatter_single(part, x)
    if collective == "all_to_all":
        out = torch.empty(numel)
        return lambda: dist.all_to_all_single(out, x)
    if collective == "send_recv":  # rank 0 sends to rank 1; the others wait at the barrier
        if rank == 0: return lambda: dist.send(x, dst=1)
        if rank == 1: return lambda: dist.recv(x, src=0)
        return lambda: None
    raise ValueError(f"collective {collective!r}: choose one of {', '.join(COLLECTIVES)}")


def comm_worker(out_dir, sizes, repeats=5, collectives=COLLECTIVES):
    "Worker: time every collective at every size (bytes); rank 0 writes `comm-<n>.json`."
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = []
    for c in collectives:
        for size in sizes:
            numel = max(n, size // 4 // n * n)  # divisible by n: every rank gets an equal part
            op, times = _op(c, numel, rank, n), []
            for i in range(repeats + 1):
                dist.barrier()
                t0 = time.perf_counter()
                op()
                if i: times.append(time.perf_counter() - t0)  # the first call is a warm-up
            t = torch.tensor([statistics.median(times)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank does
            nbytes = 4 * numel
            algbw = nbytes / t.item()
            rows.append({"collective": c, "bytes": nbytes, "seconds": t.item(), "algbw": algbw,
                         "busbw": algbw * bus_factor(c, n)})
    if rank == 0: Path(out_dir, f"comm-{n}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def measure(worlds=(2, 4), max_mib=16, repeats=5) -> dict:
    "{world size: rows} for sizes 1 KiB, 4 KiB, ... up to `max_mib` MiB, each world size its own launch."
    from distcourse.launch import launch
    sizes = [4 ** k * 1024 for k in range(20) if 4 ** k * 1024 <= max_mib * 2**20]
    with tempfile.TemporaryDirectory() as tmp:
        for n in worlds: launch(comm_worker, (tmp, sizes, repeats), num_processes=n)
        return {n: json.loads(Path(tmp, f"comm-{n}.json").read_text()) for n in worlds}


def table(results) -> str:
    "Latency (µs) at the smallest size and bus bandwidth (GB/s) at the largest, per collective and world size."
    lines = ["| collective | world | latency, smallest (µs) | busbw, largest (GB/s) |", "|---|---|---|---|"]
    for n, rows in results.items():
        for c in COLLECTIVES:
            mine = [r for r in rows if r["collective"] == c]
            if mine: lines.append(f"| {c} | {n} | {mine[0]['seconds'] * 1e6:,.0f} | {mine[-1]['busbw'] / 1e9:.2f} |")
    return "\n".join(lines)


def plot(results, path=None):
    "Bus bandwidth against message size, one panel per world size, one line per collective."
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.5), squeeze=False)
    for ax, (n, rows) in zip(axes[0], results.items()):
        for c in COLLECTIVES:
            mine = [r for r in rows if r["collective"] == c]
            ax.plot([r["bytes"] for r in mine], [r["busbw"] / 1e9 for r in mine], "o-", label=c, markersize=3)
        ax.set(xscale="log", xlabel="message (bytes)", ylabel="bus bandwidth (GB/s)", title=f"{n} gloo processes")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    if path: fig.savefig(path, dpi=100)
    return fig


def main(argv=None):
    p = argparse.ArgumentParser(prog="python benchmarks/bench_comm.py", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, nargs="+", default=[2, 4], help="world sizes, each its own launch")
    p.add_argument("--max_mib", type=int, default=64, help="largest message, MiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(HERE / "comm.json"))
    args = p.parse_args(argv)
    res = measure(args.world, args.max_mib, args.repeats)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    main()
