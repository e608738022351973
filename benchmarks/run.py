"""Measure the course's trainer side by side with its peers, in one run, and write `results.json` + `results.md`.

    python benchmarks/run.py --quick          # minutes on a 2-core CPU: results.json, then the tables rendered
    python benchmarks/run.py                  # full: batch 16, more turns (on a GPU: GPT-2 124M's shape, bf16)
    python benchmarks/run.py --compile        # every contender torch.compile'd
    python benchmarks/run.py --smoke --out DIR  # seconds: what tests/test_benchmarks.py runs
    python benchmarks/run.py --quick --paths  # + fp32/bf16 x eager/compile, and the main job's own tokens/s

Written into benchmarks/ (the default --out), a run also rewrites docs/benchmarks.md's and RESULTS.md's tables from its
results.json (benchmarks/render.py, which holds the targets).

Contenders take turns step by step in one process (warm-up excluded, medians over turns), so a neighbour's
load slows all of them alike; every target is a ratio of two numbers measured in the same run. The main job
(a launched trainer) is timed in `--pairs` rounds against the fastest path and the Trainer's defaults, in
alternating order (bench_pairs.py); every ratio is the median of its per-pair ratios, with min, max and pairs.
"""
import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench_steps / bench_data: importable by name, also in launched processes
for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"): os.environ.setdefault(k, "1")

import accelerate, datasets, tokenizers, torch, transformers  # noqa: E402

import distcourse  # noqa: E402
from distcourse.comm import TIMED, measure_collectives, predicted_all_reduce_s  # noqa: E402
from distcourse.launch import make_accelerator  # noqa: E402
from distcourse.memory import PeakMemory, adamw_peak_bytes  # noqa: E402
from distcourse.gpt import flops_per_token  # noqa: E402
from distcourse.model import num_params  # noqa: E402
from distcourse.profiling import exposed_comm_fraction  # noqa: E402
from distcourse.tracking import DATASHEET_FLOPS, datasheet_gpu  # noqa: E402

from bench_data import data_throughput, padding_waste  # noqa: E402
import bench_comm  # noqa: E402
import bench_ddp  # noqa: E402
from bench_tp import measure_tp  # noqa: E402
from bench_steps import Bench, DistcourseStep, Matmul, TorchLoop, build, hf_trainer, take_turns  # noqa: E402
from bench_pairs import MainJobRuns, StepRuns, TrainerRuns, time_to_loss  # noqa: E402
from pairing import paired, rounds, summary_line  # noqa: E402
import render  # noqa: E402  (the targets and the tables)
from render import MAIN_JOB_SHAPE, table, targets  # noqa: E402

CUDA = torch.cuda.is_available()
# mode -> (what the contenders train, what the 1- vs 2-process runs train (global batch), data options, matmul size)
MODES = {
    "smoke": (Bench("tiny", 4, 32, warmup=1, steps=3), Bench("tiny", 4, 32, warmup=1, steps=2),
              dict(max_docs=300, repeats=1), 512),
    "quick": (Bench("small", 8, 128, warmup=2, steps=16), Bench("small", 8, 128, warmup=2, steps=16),
              dict(repeats=2), 2048),
    "full": (Bench("small", 16, 128, warmup=3, steps=60), Bench("small", 16, 128, warmup=3, steps=40),
             dict(repeats=3), 2048),
}
GPU_BENCH = Bench("base", 16, 1024, precision="bf16", vocab_size=50304, device="cuda", warmup=3, steps=30, chunk=5)
# DDP on 2 processes (lesson 03b's `mlp`): gradients all-reduced after backward, in one bucket, in 2 MiB buckets
OVERLAP = {"no overlap": None, "one bucket": 1024, "2 MiB buckets": 2}
# mode -> (rounds of the main job against the fastest path and the Trainer's defaults, the main job's steps and
#          log interval in a round, the others' timed steps in a round, time to the same loss: steps, eval every)
PAIRS = {"smoke": (2, 6, 2, 3, (8, 4)), "quick": (5, 25, 5, 15, (80, 16)), "full": (7, 40, 5, 25, (450, 50))}
JOB_COMPILE = {"smoke": "false", "quick": "true", "full": "true"}  # smoke: no compile (seconds, not speed)
PATHS = {"fp32 eager": ("fp32", False), "fp32 compile": ("fp32", True), "bf16 eager": ("bf16", False),
         "bf16 compile": ("bf16", True)}


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_name() -> str:
    try: return next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration): return platform.processor() or "unknown CPU"


def quartiles(xs) -> list:
    "[25th, 75th] percentile."
    return statistics.quantiles(xs, n=4)[::2] if len(xs) > 1 else [xs[0], xs[0]]


def contenders(b: Bench, matmul_n, hf, tmp) -> dict:
    "Per-step seconds of each contender (and of the matmul), taking turns; warm-up turns dropped."
    records = {}
    def record(name, seconds, work): records.setdefault(name, []).append((seconds, work))
    dtype = torch.bfloat16 if b.precision == "bf16" else torch.float32
    acc = make_accelerator(mixed_precision="bf16" if b.precision == "bf16" else "no")
    others = [TorchLoop(b), DistcourseStep(b, acc), Matmul(b.device, dtype, matmul_n, reps=20 if CUDA else 1)]
    if hf: hf_trainer(b, others, record, tmp)  # the Trainer's loop drives; the others take turns in a callback
    else:
        for turn in range(b.warmup + b.steps): take_turns(others, b, record, turn)
    out = {k: {"step_s": [s for s, _ in v[b.warmup:]], "work_per_step": v[-1][1]} for k, v in records.items()}
    return out | {"memory": None if b.compile else {c.name: step_peaks(c) for c in others[:2]}}


def step_peaks(c) -> dict:
    "One more step of a trainer under lesson 05's PeakMemory: measured peaks beside the memory model's terms."
    with PeakMemory(c.model, c.opt) as pm: c.step()  # a dispatch-mode tracker: timed steps run without it
    peak = pm.peaks[str(next(c.model.parameters()).device)]
    ps, opt = list(c.model.parameters()), getattr(c.opt, "optimizer", c.opt)
    n = sum(p.numel() for p in ps)  # fp32 weights, gradients and AdamW state, whatever autocast computes in
    adam = adamw_peak_bytes([[p.numel() for p in g["params"]] for g in opt.param_groups])
    return {"peak": {k: peak[k] for k in ("PARAM", "GRAD", "OPT", "ACT", "TEMP")},
            "predicted": {"PARAM": 4 * n, "GRAD": 4 * n, "OPT": sum(adam.values())}, "opt_terms": adam}


def summarize(per, b: Bench, model) -> dict:
    "Tokens/s; ratios and model FLOPs over the matmul's rate as medians over turns of what ran back to back."
    rate = {k: [v["work_per_step"] / s for s in v["step_s"]] for k, v in per.items()}  # tokens/s (matmul: FLOP/s)
    tps = {k: statistics.median(v) for k, v in rate.items() if k != "matmul"}
    fpt = flops_per_token(model, b.seq_len)
    def ratio(a, c):  # the turns are the pairs: their order alternates (take_turns)
        p = paired(rate[a], rate[c])
        return p | {"paired_iqr": quartiles(p["per_pair"]), "ratio_of_medians": tps[a] / tps[c]}
    mm = {k: statistics.median([fpt * x / peak for x, peak in zip(rate[k], rate["matmul"])]) for k in tps}
    out = {"tokens_per_s": tps, "tokens_per_s_iqr": {k: quartiles(rate[k]) for k in tps},
           "step_s": {k: v["step_s"] for k, v in per.items()}, "flops_per_token": fpt,
           "peak_flops": statistics.median(rate["matmul"]), "peak_flops_iqr": quartiles(rate["matmul"]),
           "mm_utilisation_by_contender": mm, "ratios": {"loop_vs_torch": ratio("distcourse", "torch")}}
    if "hf_trainer" in tps:
        out["ratios"] |= {"loop_vs_hf_trainer": ratio("distcourse", "hf_trainer"),
                          "hf_trainer_vs_torch": ratio("hf_trainer", "torch")}
    return out


def paths(b: Bench, matmul_n, model, tmp) -> dict:
    "torch loop and distcourse step side by side on each of fp32/bf16 x eager/compile (what the hardware offers)."
    from distcourse.launch import _fresh_accelerate_state  # each path's Accelerator as a new process would make it
    out = {}
    for name, (precision, compiled) in PATHS.items():
        hf = name in ("fp32 eager", "bf16 compile")  # the Trainer's default precision, and the course's default
        with _fresh_accelerate_state():
            per = contenders(replace(b, precision=precision, compile=compiled), matmul_n, hf, tmp)
            per.pop("memory")
        r = summarize(per, b, model)
        mine = {k: r["ratios"][k] for k in ("loop_vs_torch", "loop_vs_hf_trainer") if k in r["ratios"]}
        out[name] = {"tokens_per_s": r["tokens_per_s"], **{k: v["ratio"] for k, v in mine.items()},
                     "paired": {k: {x: v[x] for x in ("ratio", "min", "max", "pairs")} for k, v in mine.items()}}
    return out


def main_job(b: Bench, path: str, mode: str, k: int, tmp) -> dict:
    "The trainer with its defaults, launched, in `k` rounds against the fastest path and the Trainer's defaults."
    _, steps, log_every, n, _ = PAIRS[mode]
    precision, compiled = PATHS[path]
    runs = {f"{path} (distcourse step)": StepRuns(replace(b, precision=precision, compile=compiled), n),
            "main job": (job := MainJobRuns(b, steps, log_every, Path(tmp, "rounds"), JOB_COMPILE[mode])),
            "hf_trainer, fp32 eager": TrainerRuns(replace(b, precision="fp32", compile=False), n, Path(tmp, "hf"))}
    rates, order = rounds(runs, k)  # path, main job, Trainer; then Trainer, main job, path: the main job between
    best, mine, hf = rates.values()
    run = job.runs[-1]
    return {"main_job": {"tokens_per_s": statistics.median(mine), "steps": steps, "log_every": log_every,
                         "choices": run["choices"], "mixed_precision": run["mixed_precision"]},
            "rounds": {"order": order, "tokens_per_s": rates, "best_path": path, "other_steps": n},
            "main_job_vs_best_path": paired(mine, best), "defaults_vs_hf_trainer_defaults": paired(mine, hf)}


def environment(b: Bench) -> dict:
    "Device, library versions and thread counts of this run."
    device = f"cuda: {torch.cuda.get_device_name()}" if b.device == "cuda" else f"cpu: {cpu_name()}"
    return {"device": f"{device} ({cores()} cores available)",
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "accelerate": accelerate.__version__,
                         "datasets": datasets.__version__, "tokenizers": tokenizers.__version__,
                         "distcourse": distcourse.__version__, "platform": platform.platform()},
            "threads": {"torch": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
                        "cores": cores(), "OMP_NUM_THREADS": os.getenv("OMP_NUM_THREADS"),
                        "float32_matmul_precision": torch.get_float32_matmul_precision(),
                        "TOKENIZERS_PARALLELISM": os.getenv("TOKENIZERS_PARALLELISM")}}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="~50 s on an idle 2-core CPU (full: ~4 min)")
    mode.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: checks the harness, not speed")
    for k, t in (("model", str), ("batch_size", int), ("seq_len", int), ("precision", str), ("vocab_size", int),
                 ("warmup", int), ("steps", int), ("chunk", int)):
        p.add_argument(f"--{k}", type=t, help=f"override the mode's {k}")
    p.add_argument("--compile", action="store_true", help="torch.compile every contender's model")
    p.add_argument("--no_ddp", action="store_true", help="skip the 1- vs 2-process measurement")
    p.add_argument("--no_hf", action="store_true", help="skip transformers.Trainer")
    p.add_argument("--no_comm", action="store_true", help="skip the collectives (latency, bus bandwidth)")
    p.add_argument("--no_tp", action="store_true", help="skip tensor parallelism (tokens/s at tp 1 and 2)")
    p.add_argument("--no_overlap", action="store_true", help="skip DDP's exposed communication (lesson 03b)")
    p.add_argument("--paths", action="store_true", help="also fp32/bf16 x eager/compile and the main job itself "
                   "(at the main job's batch, 16 x 128; ~5 min on 2 cores)")
    p.add_argument("--pairs", type=int, help="rounds of the main job against the fastest path and the Trainer "
                   "(order alternating; default: smoke 2, quick 5, full 7)")
    p.add_argument("--best_path", choices=list(PATHS), help="with --paths: time only the rounds (and time to the "
                   "loss), the main job against this path, not the four paths first (their table is left out)")
    p.add_argument("--no_ttl", action="store_true", help="with --paths: skip time to the same validation loss")
    p.add_argument("--out", default=str(HERE), help="directory for results.json and results.md")
    return p.parse_args(argv)


def main(argv=None):
    t0, args, sections = time.time(), parse(argv), {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that launched workers are stopped on the way out
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    Path(args.out).mkdir(parents=True, exist_ok=True)  # before any part writes a figure into it
    b, b_ddp, data_kw, matmul_n = MODES[mode]
    if CUDA and mode != "smoke":
        b, matmul_n = replace(GPU_BENCH, steps=10 if mode == "quick" else GPU_BENCH.steps), 8192
    b = replace(b, compile=args.compile, **{k: getattr(args, k) for k in ("model", "batch_size", "seq_len",
                "precision", "vocab_size", "warmup", "steps", "chunk") if getattr(args, k) is not None})
    if CUDA and mode == "smoke": b = replace(b, device="cuda")
    if b.precision not in ("fp32", "bf16"): sys.exit(f"--precision {b.precision}: choose fp32 or bf16")
    torch.set_num_threads(cores())
    if CUDA: torch.set_float32_matmul_precision("high")
    datasets.disable_progress_bars(); transformers.logging.set_verbosity_error()
    model, _ = build(b)  # builds the data caches once, before any process is launched
    if not args.no_ddp: build(b_ddp)
    res = {"mode": mode, "command": " ".join(["python benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)]),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **environment(b),
           "config": asdict(b) | {"num_params": num_params(model), "matmul_n": matmul_n},
           "load_average": {"start": os.getloadavg()[0]}}  # other programs' load: tokens/s move with it, ratios less
    t = time.time()
    res["padding_waste"] = padding_waste(b.seq_len, b.batch_size, data_kw.get("max_docs"))
    res["data"] = data_throughput(b.seq_len, b.batch_size, **data_kw)
    res["data_tokens_per_s"] = res["data"]["data_tokens_per_s"]
    sections["data"], t = time.time() - t, time.time()
    res["ddp"] = None if args.no_ddp else bench_ddp.summarize(bench_ddp.ddp_turns(b_ddp, cores()), b_ddp, cores())
    for k in ("processes_vs_threads", "weak_scaling", "strong_scaling"):  # scaling: with a core per process
        res[k] = res["ddp"][k] if res["ddp"] else None
    sections["ddp"], t = time.time() - t, time.time()
    if not args.no_comm:  # the collectives lesson's measurement: latency and bus bandwidth by message size
        worlds, max_mib = ((2,), 1) if mode == "smoke" else ((2, 4), 4 if mode == "quick" else 16)
        res["comm"] = measure_collectives(worlds, max_mib, repeats=2 if mode == "smoke" else 5)
        res["comm_busbw_largest"] = {f"{c}/{n}": [r for r in rows if r["collective"] == c][-1]["busbw"]
                                     for n, rows in res["comm"].items() for c in TIMED}
        if res["ddp"]:  # lesson 03a's prediction of DDP's all-reduce from this table, beside its measurement
            ddp = res["ddp"]
            ddp["allreduce_predicted_s"] = predicted_all_reduce_s(res["comm"][2], ddp["allreduce_bytes"])
        bench_comm.plot(res["comm"], Path(args.out) / "comm.png")
    sections["comm"], t = time.time() - t, time.time()
    res["tp"] = None if args.no_tp or CUDA else measure_tp("smoke" if mode == "smoke" else "quick")  # lesson 05c
    sections["tp"], t = time.time() - t, time.time()
    if not args.no_overlap:  # lesson 03b: the share of a DDP step's communication that backward did not hide
        size = dict(width=128, layers=4, batch=16, steps=2) if mode == "smoke" else {}
        res["overlap"] = {k: exposed_comm_fraction(cap, **size) for k, cap in OVERLAP.items()}
        sections["overlap"], t = time.time() - t, time.time()
    with tempfile.TemporaryDirectory() as tmp:
        per = contenders(b, matmul_n, not args.no_hf, tmp)
        res["memory"] = per.pop("memory")  # bytes per rank: measured peaks, the model's prediction beside
        res |= summarize(per, b, model)
    sections["contenders"] = time.time() - t
    res |= {k: v["ratio"] for k, v in res["ratios"].items()}
    res["paired"] = {k: {x: v[x] for x in ("ratio", "min", "max", "pairs")} for k, v in res["ratios"].items()}
    if res["ddp"]:  # its turns are the pairs too (order alternating)
        s = res["ddp"]["step_s"]
        res["paired"]["processes_vs_threads"] = {x: v for x, v in paired([1 / x for x in s["2x1"]],
                                                 [1 / x for x in s["1x2"]]).items() if x != "per_pair"}
    res["main_job_vs_best_path"] = None
    if args.paths:
        t = t_paths = time.time()
        shape, (warmup, steps) = ((8, 64), (1, 4)) if mode == "smoke" else (MAIN_JOB_SHAPE, (2, 10))  # smoke: cheap
        job_b = replace(b, batch_size=shape[0], seq_len=shape[1], warmup=warmup, steps=steps)
        res["job_shape"] = list(shape)
        k = args.pairs or PAIRS[mode][0]
        with tempfile.TemporaryDirectory() as tmp:
            res["paths"] = None if args.best_path else paths(job_b, matmul_n, model, tmp)
            sections["paths_contenders"], t = time.time() - t, time.time()
            best = args.best_path or max(res["paths"], key=lambda p: res["paths"][p]["tokens_per_s"]["distcourse"])
            # The course's defaults (bf16 where native, compiled) against the fastest path, and against
            # transformers.Trainer's (fp32, eager; the optimizer matched: torch AdamW), in alternating rounds
            job = main_job(job_b, best, mode, k, tmp)
            res["paired"] |= {x: job.pop(x) for x in ("main_job_vs_best_path", "defaults_vs_hf_trainer_defaults")}
            res |= job
            sections["rounds"], t = time.time() - t, time.time()
            (Path(args.out) / "rounds.json").write_text(  # kept should a later part not finish
                json.dumps(res, indent=1, default=str) + "\n")
            if not args.no_ttl:  # the defaults against the Trainer's: training seconds to the same validation loss
                steps, every = PAIRS[mode][4]
                res["time_to_loss"] = ttl = time_to_loss(job_b, steps, every, tmp,
                                                         res["paired"]["defaults_vs_hf_trainer_defaults"]["ratio"],
                                                         JOB_COMPILE[mode])
                res["defaults_time_to_loss_vs_hf_trainer"] = ttl["ratio"]
                sections["time_to_loss"] = time.time() - t
        if res["paths"]: res["paired"]["matched_vs_hf_trainer"] = res["paths"]["bf16 compile"]["paired"]["loop_vs_hf_trainer"]
        for x in ("main_job_vs_best_path", "defaults_vs_hf_trainer_defaults", "matched_vs_hf_trainer"):
            res[x] = res["paired"][x]["ratio"] if x in res["paired"] else None
        sections["paths"] = time.time() - t_paths  # of which: paths_contenders, rounds, time_to_loss
    res.setdefault("loop_vs_hf_trainer", None)
    res["mm_utilisation"] = res["mm_utilisation_by_contender"]["distcourse"]  # over a measured matmul: not MFU
    card = datasheet_gpu(torch.cuda.get_device_name()) if b.device == "cuda" else None
    sheet = DATASHEET_FLOPS[card]["bf16"] if card and b.precision == "bf16" else None  # fp32 here runs on TF32
    res["mfu"] = res["flops_per_token"] * res["tokens_per_s"]["distcourse"] / sheet if sheet else None  # PaLM's MFU
    res["peak"] = {"flops_per_s": res["peak_flops"], "what": f"torch.mm {matmul_n}x{matmul_n}, {b.precision}, "
                   f"on {b.device}", "card": card, "datasheet_flops_per_s": sheet}
    res["load_average"]["end"] = os.getloadavg()[0]
    res["targets"], res["section_s"], res["wall_s"] = targets(res), sections, time.time() - t0
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "results.md").write_text(table(res))
    print(table(res))
    for k, v in res["paired"].items(): print(summary_line(k, v))
    if out.resolve() == HERE: render.main([])  # docs/benchmarks.md's and RESULTS.md's tables follow the new results.json
    return res


if __name__ == "__main__": main()
