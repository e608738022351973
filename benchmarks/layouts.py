"""Every layout the trainer accepts at world size 4 and 2, trained a few steps with one global batch and sequence
length: seconds per optimizer step and every rank's peak memory, in `layouts.json` (the measurements the planner's
predictions are checked against, issue 29).

    python benchmarks/layouts.py                            # ~20 min on 2 quiet CPU cores: benchmarks/layouts.json
    python benchmarks/layouts.py --quick --out /tmp/l.json  # a few layouts at world size 2, 5 steps

A layout is first given to the trainer's own `parse_args` (what each rank runs first, WORLD_SIZE set as a launch
sets it): a refused one is recorded with the line the trainer prints before exiting 2, and not launched. An
accepted one runs `distcourse.train.main` on `world` processes forked from this one (lesson 02a's `launch`, as
tests/conftest.py's `trainer_cmd` does, with torch imported once here), then its `metrics.jsonl` and `run.json`
are read: a step's seconds are its tokens over its record's tokens_per_s (the trainer's `Meter`: the step alone,
not the logging), and each rank's peak is lesson 05's `PeakMemory` of the first step (`peak_first_step`).
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from itertools import product
from pathlib import Path

for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"): os.environ.setdefault(k, "1")

import torch  # noqa: E402
from accelerate.utils import patch_environment  # noqa: E402

from distcourse.config import ConfigError, parse_args  # noqa: E402
from distcourse.data import get_tokenizer  # noqa: E402
from distcourse.launch import launch  # noqa: E402
from distcourse.memory import STAGES  # noqa: E402
from distcourse.layout import CP_IMPLS, PP_SCHEDULES  # noqa: E402
from distcourse.model import PRESETS, build_model, num_params  # noqa: E402
from distcourse.train import main as train_main  # noqa: E402

HERE = Path(__file__).resolve().parent
WARMUP = 2  # optimizer steps left out of step_s: the first is PeakMemory's, the second the allocator's


def layouts(world):
    "Every (dp, tp, pp, cp) of `world` with each schedule, cp attention, ZeRO stage and recomputation to try."
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for tp, pp, cp in product(divisors, repeat=3):
        if world % (tp * pp * cp): continue
        dp, mesh = world // (tp * pp * cp), tp * pp * cp > 1
        # dp alone: every stage with and without recomputation; a mesh: plain, recomputed, and each ZeRO stage once
        # (1 and any stage with pp refused: the trainer's line is recorded)
        variants = [(z, ac) for z in (STAGES if dp > 1 else (0,)) for ac in (False, True)]
        if mesh: variants = [(0, False), (0, True)] + ([(z, False) for z in STAGES if z] if dp > 1 else [])
        for schedule, impl, (zero, ac) in product(PP_SCHEDULES if pp > 1 else (None,),
                                                  CP_IMPLS if cp > 1 else (None,), variants):
            yield {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "cp_impl": impl, "zero_stage": zero,
                   "pp_schedule": schedule, "activation_checkpointing": ac}


def name(lay) -> str:
    "dp2·pp2 1f1b m4, dp4 z2 ac: a layout in a few characters."
    axes = "·".join(f"{k}{lay[k]}" for k in ("dp", "tp", "pp", "cp") if lay[k] > 1) or "dp1"
    extra = [lay["pp_schedule"] and f"{lay['pp_schedule']} m{lay['grad_accum']}", lay["cp_impl"],
             lay["zero_stage"] and f"z{lay['zero_stage']}", lay["activation_checkpointing"] and "ac"]
    return " ".join([axes, *filter(None, extra)])


def plain(lay) -> bool:
    "A layout --quick keeps: no ZeRO, no recomputation, 1F1B and the ring where they apply."
    return (not lay["zero_stage"] and not lay["activation_checkpointing"]
            and lay["pp_schedule"] in (None, "1f1b") and lay["cp_impl"] in (None, "ring"))


def flags(lay, args, out_dir) -> list:
    "The trainer's command line for `lay` (fp32, no compile, no tracker, no evaluation between start and end)."
    f = {"model": args.model, "n_layer": args.n_layer, "seq_len": args.seq_len, "batch_size": lay["batch_size"],
         "grad_accum": lay["grad_accum"], "max_steps": args.steps, "warmup_steps": WARMUP, "log_every": 1,
         "eval_every": 0, "tracker": "none", "compile": "false", "mixed_precision": "no", "seed": 0,
         "max_examples": args.max_examples, "zero_stage": lay["zero_stage"],
         "activation_checkpointing": str(lay["activation_checkpointing"]).lower(),
         "tp": lay["tp"], "pp": lay["pp"], "cp": lay["cp"], "output_dir": out_dir}
    if lay["pp"] > 1: f["pp_schedule"] = lay["pp_schedule"]
    if lay["cp"] > 1: f["cp_impl"] = lay["cp_impl"]
    return [s for k, v in f.items() for s in (f"--{k}", str(v))]


def sized(lay, args) -> dict:
    "`lay` with its micro-batches (2 per stage under pp: every schedule's least) and batch_size for the global batch."
    ga = 2 * lay["pp"] if lay["pp"] > 1 else 1
    return {**lay, "grad_accum": ga, "batch_size": args.global_batch // (lay["dp"] * ga)}


def refusal(argv, world):
    "The line the trainer prints for `argv` on `world` processes before exiting 2, or None if it accepts it."
    with patch_environment(WORLD_SIZE=str(world)):  # what the layout check reads in every rank
        try: parse_args(argv)
        except ConfigError as e: return f"distcourse.train: error: {e}"
    return None


def measure(argv, world, out_dir, args) -> dict:
    "Train `argv` on `world` processes; per-step seconds after WARMUP, every rank's peak and memory terms."
    t0, load = time.perf_counter(), round(os.getloadavg()[0], 2)  # others' work on the 2 cores, before this run
    try: launch(train_main, (argv,), num_processes=world, timeout=args.timeout)
    except (Exception, SystemExit) as e:  # a refusal after the start (exit 2), a crash, the time limit
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"}
    wall = time.perf_counter() - t0
    recs = [json.loads(l) for l in open(Path(out_dir, "metrics.jsonl")) if l.strip()]
    tokens = args.global_batch * args.seq_len  # what Meter counts per step: every sequence's input ids
    steps = [tokens / r["tokens_per_s"] for r in recs if "split" not in r and r["step"] > WARMUP]
    run = json.loads(Path(out_dir, "run.json").read_text())
    ranks = run["memory"]["per_rank"]
    peaks = [r.get("peak_first_step") for r in ranks]
    measured = all(isinstance(p, dict) for p in peaks)
    cpu = [next(iter(p.values())) for p in peaks] if measured else None  # {category: bytes} of the one device
    counted = [{k: v for k, v in r.items() if k.endswith("_bytes")} for r in ranks]
    return {"step_s_all": steps, "wall_s": round(wall, 2), "load_avg": load, "parallel": run["parallel"],
            "peak_bytes": [p["Total"] for p in cpu] if cpu else None,
            "peak_why": None if measured else next(p for p in peaks if not isinstance(p, dict)),
            "terms": {"counted": counted, "peak": [{k: v for k, v in p.items() if k != "Total"} for p in cpu]
                      if cpu else None}}


def model_info(args) -> dict:
    "The preset's sizes at --n_layer, the tokenizer's vocabulary and the parameters the trainer counts."
    tok = get_tokenizer("stdlib")
    model = build_model(args.model, "clm", tokenizer=tok, n_layer=args.n_layer)
    sizes = {k: v for k, v in PRESETS[args.model].items() if k in ("n_embd", "n_head", "n_positions")}
    return {"preset": args.model, "n_layer": args.n_layer, **sizes, "vocab_size": len(tok),
            "n_params": num_params(model)}


def machine() -> dict:
    cpus = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")]
    return {"cpu": cpus[0] if cpus else platform.processor(), "cores": os.cpu_count(), "torch": torch.__version__}


def table(runs) -> str:
    "One line per layout: step seconds (median of every kept step), each rank's peak in MB, or the refusal."
    lines = [f"{'world':>5}  {'layout':<28} {'step_s':>7}  peak MB per rank"]
    for r in runs:
        lay = name(r["layout"])
        if r["refused"]: lines.append(f"{r['world']:>5}  {lay:<28} {'refused':>7}  {r['refused'][26:100]}")
        elif r.get("error") or r["step_s"] is None:
            lines.append(f"{r['world']:>5}  {lay:<28} {'-':>7}  {r.get('error') or 'not run (time)'}")
        else:
            peak = " ".join(f"{b / 2**20:.0f}" for b in r["peak_bytes"]) if r["peak_bytes"] else r["peak_why"][:60]
            lines.append(f"{r['world']:>5}  {lay:<28} {r['step_s']:>7.3f}  {peak}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="world size 2, a layout per axis, 5 steps")
    p.add_argument("--out", default=str(HERE / "layouts.json"))
    p.add_argument("--model", default="small")
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--global_batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--max_examples", type=int, default=400)
    p.add_argument("--worlds", default="4,2,1", help="world sizes, in the order they run")
    p.add_argument("--repeats", type=int, default=3, help="passes over the layouts, every other one reversed")
    p.add_argument("--only", default="", help="only these layouts, by name, comma-separated: 'dp4 z2,tp4'")
    p.add_argument("--until", default="", help="HH:MM UTC: start no run after it (the rest: not_run says so)")
    p.add_argument("--timeout", type=float, default=300, help="seconds before a launch is stopped")
    args = p.parse_args(argv)
    if args.quick: args.worlds, args.steps, args.repeats = "2", 5, 1
    t_start = time.time()
    out = {"command": " ".join(["python", *sys.argv]), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": machine(), "model": model_info(args), "seq_len": args.seq_len,
           "global_batch": args.global_batch, "steps": args.steps, "warmup_steps_left_out": WARMUP,
           "note": "flags: --output_dir OUT is a fresh temporary directory; load_avg: 1-min load before each run",
           "runs": []}
    for world in map(int, args.worlds.split(",")):
        for lay in layouts(world):
            lay = sized(lay, args)
            if args.only and name(lay) not in args.only.split(","): continue
            if args.quick and not plain(lay): continue
            argv = flags(lay, args, "OUT")
            out["runs"].append({"world": world, "layout": lay, "flags": argv, "refused": refusal(argv, world),
                                "step_s": None, "step_s_all": [], "pass_step_s": [], "wall_s": [], "load_avg": [],
                                "peak_bytes": None, "peak_why": None, "terms": None})
    todo = [r for r in out["runs"] if not r["refused"]]
    deadline = None
    if args.until:
        hh, mm = map(int, args.until.split(":"))
        deadline = datetime.now(timezone.utc).replace(hour=hh, minute=mm, second=0).timestamp()
    for rep in range(args.repeats):
        for r in (todo if rep % 2 == 0 else todo[::-1]):  # alternating order: a neighbour's load spreads over both
            if deadline and time.time() > deadline:
                if not r["step_s_all"]: r["not_run"] = f"no time left: --until {args.until} UTC passed"
                continue
            if r.get("error"): continue
            with tempfile.TemporaryDirectory() as d:
                argv = [d if a == "OUT" else a for a in r["flags"]]
                print(f"[{datetime.now(timezone.utc):%H:%M:%S}] pass {rep + 1}, world {r['world']}: "
                      f"{name(r['layout'])}", flush=True)
                got = measure(argv, r["world"], d, args)
            if "error" in got: r["error"] = got["error"]; continue
            r["pass_step_s"].append(statistics.median(got["step_s_all"]))
            r["step_s_all"] += got["step_s_all"]
            r["step_s"] = statistics.median(r["step_s_all"])
            r["wall_s"].append(got["wall_s"])
            r["load_avg"].append(got["load_avg"])
            r["parallel"] = got["parallel"]  # what the trainer says it ran: its dp, tp, pp, cp and cp_impl
            r["peak_bytes"], r["peak_why"], r["terms"] = got["peak_bytes"], got["peak_why"], got["terms"]
            out["wall_time_s"] = round(time.time() - t_start, 1)
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")  # after every run: a cut-off keeps them
    out["wall_time_s"] = round(time.time() - t_start, 1)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(table(out["runs"]))
    print(f"{len(todo)} accepted, {len(out['runs']) - len(todo)} refused; {out['wall_time_s']:.0f} s; {args.out}")


if __name__ == "__main__":
    main()
