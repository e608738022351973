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
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from distcourse.comm import TIMED, measure_collectives  # noqa: E402  (the collectives lesson's worker)


def table(results) -> str:
    "Latency (µs) at the smallest size and bus bandwidth (GB/s) at the largest, per collective and world size."
    lines = ["| collective | world | latency, smallest (µs) | busbw, largest (GB/s) |", "|---|---|---|---|"]
    for n, rows in results.items():
        for c in TIMED:
            mine = [r for r in rows if r["collective"] == c]
            if mine: lines.append(f"| {c} | {n} | {mine[0]['seconds'] * 1e6:,.0f} | {mine[-1]['busbw'] / 1e9:.2f} |")
    return "\n".join(lines)


def plot(results, path=None):
    "Bus bandwidth against message size, one panel per world size, one line per collective."
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.5), squeeze=False)
    for ax, (n, rows) in zip(axes[0], results.items()):
        for c in TIMED:
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
    res = measure_collectives(args.world, args.max_mib, args.repeats)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))


if __name__ == "__main__":
    main()
