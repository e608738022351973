"""The mesh's gradient reduction, old against new, paired in one run: every mesh layout of `layouts.json`.

    python benchmarks/bench_buckets.py                   # ~15 min on 2 quiet CPU cores: benchmarks/buckets.json
    python benchmarks/bench_buckets.py --only "dp2·cp2"  # layouts whose name starts so

Old: one all-reduce per gradient tensor (and the loss sum), over dp, then over cp (05k's step before lesson 03's
`all_reduce_buckets`). New: the step as it is, one call per 25 MiB bucket over the flattened dp × cp group. Each
layout runs once on its processes (forked by lesson 02a's `launch`): after WARMUP steps, rounds of K steps with the
old reduction and K with the new, the order alternating from round to round (ABBA), so load and the model's
progress fall on both alike. A step's time is rank 0's, between barriers; the ratio is new ÷ old of the medians.
The model, batch and micro-batches are layouts.json's (small at 4 blocks, 8 × 64 tokens a step, 2 micro-batches
per stage under pp); the batches are random tokens (the reduction does not look at them).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"): os.environ.setdefault(k, "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import distcourse.mesh as mesh_module  # noqa: E402
from distcourse.launch import launch  # noqa: E402
from distcourse.model import build_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layouts import machine, name  # noqa: E402

HERE = Path(__file__).resolve().parent
WARMUP, K, ROUNDS = 2, 3, 4  # untimed steps; steps per variant per round; rounds (ABBA: each variant first twice)


def per_tensor(mesh):
    "The old reduction: one all-reduce per tensor, over dp, then over cp (`mesh`'s groups)."
    def reduce(tensors, group=None, cap_bytes=None):
        calls = 0
        for axis in ("dp", "cp") if mesh.d["cp"] > 1 else ("dp",):
            for t in tensors: dist.all_reduce(t, group=mesh.g[axis]); calls += 1
        return calls
    return reduce


def worker(out, lay, seq_len, global_batch):
    "Worker: one layout's Mesh, stepped WARMUP times, then ROUNDS rounds of K old and K new steps; rank 0 writes."
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    hf = build_model("small", vocab_size=8192, n_layer=4)
    cfg = SimpleNamespace(tp=lay["tp"], pp=lay["pp"], cp=lay["cp"], pp_schedule=lay["pp_schedule"] or "1f1b",
                          cp_impl=lay["cp_impl"] or "ring", lr=1e-4, weight_decay=0.1, warmup_steps=2,
                          max_steps=WARMUP + 2 * K * ROUNDS)
    mesh = mesh_module.Mesh(hf, cfg)
    g, ga = torch.Generator().manual_seed(0), lay["grad_accum"]
    rows = global_batch // ga  # a global micro-batch's sequences

    def one_step():
        micro = []
        for _ in range(ga):
            x = torch.randint(0, 8192, (rows, seq_len), generator=g)
            micro.append(mesh.rows({"input_ids": x, "labels": x}))
        dist.barrier()
        t0 = time.perf_counter()
        mesh.step(micro)
        dist.barrier()
        return time.perf_counter() - t0

    new, times, calls = mesh_module.all_reduce_buckets, {"old": [], "new": []}, {}
    old = per_tensor(mesh)
    def counting(fn, key):
        def reduce(*a, **kw):
            calls[key] = fn(*a, **kw)
            return calls[key]
        return reduce
    variants = {"old": counting(old, "old"), "new": counting(new, "new")}
    for _ in range(WARMUP): one_step()
    for r in range(ROUNDS):
        for key in ("old", "new") if r % 4 in (0, 3) else ("new", "old"):  # ABBA
            mesh_module.all_reduce_buckets = variants[key]
            times[key] += [one_step() for _ in range(K)]
    mesh_module.all_reduce_buckets = new
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"times": times, "calls_per_step": calls}))
    dist.barrier()
    dist.destroy_process_group()


def mesh_layouts(path=HERE / "layouts.json"):
    "Every accepted layout of layouts.json that splits the model (tp, pp or cp > 1), without ZeRO or recomputation."
    data = json.loads(path.read_text())
    for r in data["runs"]:
        lay = r["layout"]
        split, plain = lay["tp"] * lay["pp"] * lay["cp"] > 1, not (lay["activation_checkpointing"] or lay["zero_stage"])
        if r["refused"] or not split or not plain: continue  # ZeRO on the mesh: accepted since this ran
        yield r["world"], lay, r["step_s"], data


def table(result) -> str:
    "The markdown table of a result (RESULTS.md holds it as rendered from the committed buckets.json)."
    lines = ["| processes | layout | all-reduces per step, old → new | old step s | new step s | new ÷ old |",
             "|---|---|---|---|---|---|"]
    for r in result["runs"]:
        c = r["calls_per_step"]
        lines.append(f"| {r['world']} | {r['layout']} | {c.get('old', 0)} → {c.get('new', 0)} | "
                     f"{r['old_step_s']:.3f} | {r['new_step_s']:.3f} | {r['new_over_old']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "buckets.json"))
    ap.add_argument("--only", default="", help="measure only layouts whose name starts with this")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per layout before its processes are stopped")
    ap.add_argument("--table", action="store_true", help="print the markdown table of --out and stop")
    args = ap.parse_args(argv)
    if args.table: return print(table(json.loads(Path(args.out).read_text())))
    rows, t_start = [], time.time()
    for world, lay, before_s, data in mesh_layouts():
        if not name(lay).startswith(args.only): continue
        out = Path(tempfile.mkdtemp()) / "times.json"
        t0 = time.perf_counter()
        launch(worker, (out, lay, data["seq_len"], data["global_batch"]), num_processes=world, timeout=args.timeout)
        got = json.loads(out.read_text())
        old, new = (statistics.median(got["times"][k]) for k in ("old", "new"))
        row = {"world": world, "layout": name(lay), "old_step_s": round(old, 4), "new_step_s": round(new, 4),
               "new_over_old": round(new / old, 3), "calls_per_step": got["calls_per_step"],
               "times": got["times"], "layouts_json_step_s": round(before_s, 4),
               "wall_s": round(time.perf_counter() - t0, 1), "load_avg": round(os.getloadavg()[0], 2)}
        rows.append(row)
        print(f"{world}  {row['layout']:<24} old {old:.3f}s  new {new:.3f}s  new/old {new / old:.3f}  "
              f"all-reduces per step {got['calls_per_step']['old']} -> {got['calls_per_step']['new']}", flush=True)
    result = {"command": "python benchmarks/bench_buckets.py" + (f" --only '{args.only}'" if args.only else ""),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "warmup_steps": WARMUP, "steps_per_variant_per_round": K, "rounds": ROUNDS,
              "wall_s": round(time.time() - t_start, 1), "runs": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
