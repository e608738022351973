"""One command for the first person with GPUs: every training path for a few steps, each compared with one process.

    python benchmarks/gpu_check.py                  # every GPU here (1, 2, 4 or 8 of them), the `small` model
    python benchmarks/gpu_check.py --gpus 4         # fewer GPUs
    python benchmarks/gpu_check.py --cpu            # no GPU: 2 processes on the CPU (gloo), the `tiny` model
    python benchmarks/gpu_check.py --only dp,tp2    # some layouts (names as the table prints them)

Each layout is the trainer's own command (`accelerate launch --multi_gpu -m distcourse.train`: NCCL on GPUs) on the
same global batch of 8 sequences as one process, fp32, for 3 steps, and is compared the way the CPU tests compare it
(tests/test_mesh.py, tests/test_mutation.py): the loss and the gradient norm before clipping at every step, and
every parameter's full gradient at step 1, each relative to its own norm, within 1e-5 (--tol). A loss alone would
not do: AdamW and clipping hide a gradient scaled by a constant. Layouts the trainer refuses for this model and world size (its own
`validate`) are listed with the reason, not run. Prints one table and writes it, with the device, into
`gpu_check.md` and `gpu_check.json` in --out.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"): os.environ.setdefault(k, "1")
GLOBAL = 8  # sequences per optimizer step, in every layout
COMMON = ["--seq_len", "32", "--max_steps", "3", "--log_every", "1", "--eval_every", "0", "--grads_at", "1",
          "--max_examples", "400", "--lr", "3e-3", "--warmup_steps", "1", "--mixed_precision", "no",
          "--compile", "false", "--tracker", "none", "--task", "clm"]


def layouts(world) -> dict:
    "name -> trainer flags for `world` processes: data parallel (DDP, ZeRO 1-3), then every mesh degree that fits."
    out = {}
    if world > 1:
        out["dp"] = {}
        for stage in (1, 2, 3): out[f"zero{stage}"] = {"zero_stage": stage}
    for d in (2, 4, 8):
        if d > world: break
        out[f"tp{d}"] = {"tp": d}
        out[f"cp{d}"] = {"cp": d}
        for schedule in ("gpipe", "1f1b"): out[f"pp{d}_{schedule}"] = {"pp": d, "pp_schedule": schedule}
    if world >= 4:
        out["tp2_pp2"] = {"tp": 2, "pp": 2}
        out["tp2_cp2"] = {"tp": 2, "cp": 2}
    return out  # in each, the processes the mesh degrees leave over are data parallel


def batch_flags(world, flags) -> list:
    "--batch_size and --grad_accum giving GLOBAL sequences per step (a pipeline's micro-batches: >= its stages)."
    dp = world // (flags.get("tp", 1) * flags.get("pp", 1) * flags.get("cp", 1))
    accum = max(flags.get("pp", 1), 2 if GLOBAL // dp >= 2 else 1)
    return ["--batch_size", str(max(1, GLOBAL // (dp * accum))), "--grad_accum", str(accum)]


def argv(world, flags, model, out) -> list:
    "The trainer's flags for one layout."
    extra = [x for k, v in flags.items() for x in (f"--{k}", str(v))]
    return [*COMMON, "--model", model, *batch_flags(world, flags), *extra, "--output_dir", str(out)]


def refusal(world, args):
    "Why the trainer's own validation refuses these flags at this world size, or None."
    from distcourse.config import ConfigError, parse_args
    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try: parse_args(args)
    except ConfigError as e: return str(e)
    finally:
        if old is None: os.environ.pop("WORLD_SIZE")
        else: os.environ["WORLD_SIZE"] = old
    return None


def run(world, args, cpu, timeout) -> tuple:
    "(seconds, None) when the trainer ran on `world` processes, else (seconds, why not)."
    cmd = [sys.executable, "-m", "distcourse.train", *args]
    if world > 1:
        from distcourse.launch import free_port
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(world),
               "--main_process_port", str(free_port()), "-m", "distcourse.train", *args]
    env = {**os.environ, **({"ACCELERATE_USE_CPU": "true", "CUDA_VISIBLE_DEVICES": ""} if cpu else {})}
    t0 = time.time()
    try: proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired: return time.time() - t0, f"timed out after {timeout} s"
    if proc.returncode == 0: return time.time() - t0, None
    return time.time() - t0, f"exit {proc.returncode}: " + (proc.stderr.strip().splitlines() or [""])[-1][:160]


def records(out) -> list:
    "The train records (step, loss, grad_norm) of a run's metrics.jsonl."
    return [{k: r[k] for k in ("step", "loss", "grad_norm")}
            for r in map(json.loads, open(Path(out) / "metrics.jsonl")) if "split" not in r]


def compare(want, got, tol) -> dict:
    "Worst relative differences of `got` against `want`: per-step loss and grad norm, step 1's gradients."
    steps = [[r["step"] for r in x["records"]] for x in (want, got)]
    if steps[0] != steps[1]: return {"verdict": f"DIFFER: steps {steps[1]}, want {steps[0]}"}
    rel = lambda k: max(abs(g[k] - w[k]) / abs(w[k]) for w, g in zip(want["records"], got["records"]))
    loss, norm = rel("loss"), rel("grad_norm")
    gw, gg = want["grads"], got["grads"]
    if gw.keys() != gg.keys() or any(gw[k].shape != gg[k].shape for k in gw):
        return {"loss": loss, "grad_norm": norm, "verdict": "DIFFER: gradients' names or shapes"}
    def off(k):  # each tensor against its own norm: a small one (a bias) wrong by 2x would vanish in the whole's
        diff, norm = (gg[k].double() - gw[k].double()).norm().item(), gw[k].double().norm().item()
        return diff / norm if norm else diff
    grads = max(map(off, gw))
    ok = max(loss, norm, grads) <= tol
    return {"loss": loss, "grad_norm": norm, "grads": grads, "verdict": "equal" if ok else "DIFFER"}


def result(out) -> dict:
    "What a finished run gives the comparison."
    return {"records": records(out), "grads": torch.load(Path(out) / "grads_step1.pt", map_location="cpu")}


def table(rows) -> str:
    "The markdown table of the rows."
    f = lambda x: "" if x is None else f"{x:.1e}"
    lines = ["| layout | processes | loss | grad norm | step-1 grads | verdict | seconds |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['world']} | {f(r.get('loss'))} | {f(r.get('grad_norm'))} | "
                     f"{f(r.get('grads'))} | {r['verdict']} | {r.get('seconds', 0):.0f} |")
    return "\n".join(lines)


def main(argv_=None):
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py", description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=0, help="processes (one per GPU); default: the most of 8/4/2/1 present")
    p.add_argument("--cpu", action="store_true", help="no GPU: 2 CPU processes (gloo) unless --gpus says otherwise")
    p.add_argument("--model", default="", help="a preset; default small on GPUs, tiny on the CPU")
    p.add_argument("--only", default="", help="comma-separated layout names to run (default: all)")
    p.add_argument("--tol", type=float, default=1e-5, help="largest relative difference called equal")
    p.add_argument("--timeout", type=int, default=600, help="seconds per launch before it counts as hung")
    p.add_argument("--out", default="", help="where gpu_check.md/.json go (default: a temporary directory)")
    a = p.parse_args(argv_)
    cpu = a.cpu or not torch.cuda.is_available()
    have = 2 if cpu else torch.cuda.device_count()
    world = a.gpus or max(n for n in (1, 2, 4, 8) if n <= have)
    if not cpu and world > have: p.error(f"--gpus {world}: only {have} GPU(s) here; pass --gpus {have} or fewer")
    if world < 1: p.error("--gpus: at least 1")
    model = a.model or ("tiny" if cpu else "small")
    device = "CPU (gloo)" if cpu else f"{world} x {torch.cuda.get_device_name(0)} (NCCL)"
    todo = layouts(world)
    if a.only:
        unknown = set(a.only.split(",")) - set(todo)
        if unknown: p.error(f"--only {','.join(sorted(unknown))}: not a layout at {world} processes; choose from "
                            f"{', '.join(todo)}")
        todo = {k: v for k, v in todo.items() if k in a.only.split(",")}
    out = Path(a.out or tempfile.mkdtemp(prefix="gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"{device}, torch {torch.__version__}, model {model}, {GLOBAL} sequences x 32 tokens per step, 3 steps, "
          f"fp32; runs in {out}", flush=True)
    secs, failed = run(1, argv(1, {}, model, out / "one"), cpu, a.timeout)
    if failed: sys.exit(f"the one-process reference failed ({failed}); run its command by hand to see why")
    want, rows = result(out / "one"), []
    for name, flags in todo.items():
        args = argv(world, flags, model, out / name)
        row = {"layout": name, "world": world, "flags": " ".join(args[len(COMMON):-2])}
        if why := refusal(world, args): row.update(verdict=f"refused: {why}")
        else:
            row["seconds"], failed = run(world, args, cpu, a.timeout)
            row.update(compare(want, result(out / name), a.tol) if not failed else {"verdict": f"FAILED: {failed}"})
        rows.append(row)
        print(f"{name:14} {row['verdict'][:100]}", flush=True)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    text = (f"# GPU check: {device}, {stamp}\n\ntorch {torch.__version__}, model {model}, {GLOBAL} sequences x 32 "
            f"tokens per step, 3 steps, fp32; relative differences against one process (tolerance {a.tol}).\n\n"
            + table(rows) + "\n")
    (out / "gpu_check.md").write_text(text)
    (out / "gpu_check.json").write_text(json.dumps({"device": device, "date": stamp, "torch": torch.__version__,
                                                    "model": model, "tol": a.tol, "rows": rows}, indent=1))
    print("\n" + table(rows))
    bad = [r["layout"] for r in rows if r["verdict"] != "equal" and not r["verdict"].startswith("refused")]
    if bad: sys.exit(f"not equal to one process: {', '.join(bad)} (see {out})")


if __name__ == "__main__":
    main()
