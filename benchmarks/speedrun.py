"""The speedrun (lesson 05aa): the main job's model and data to the main job's validation perplexity in less time.

Each recipe runs as a practitioner runs it, `python -m distcourse.train` in a fresh process (its `auto` precision
and compile included), the main job and the speedrun in alternating rounds (pairing.py: AB, BA, ...). A round's
target is that round's main-job perplexity; its ratio is the main job's training seconds over the speedrun's, kept
only if the speedrun reached the target. Training seconds are the steps' own (the trainer's meter: evaluation,
start-up and the final save left out); the whole command's wall seconds are reported beside them. The ablation
then adds one change at a time to the main job cut to the speedrun's steps, each run once.

    python benchmarks/speedrun.py                      # 3 rounds and the ablation: ~25 min on 2 CPU cores
    python benchmarks/speedrun.py --rounds 1 --no-ablation --out /tmp/speedrun.json
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from pairing import paired, rounds, summary_line

ROOT = Path(__file__).resolve().parents[1]
SPEEDRUN = ROOT / "configs" / "speedrun.yaml"
RECIPES = {"main job": [], "speedrun": ["--config", str(SPEEDRUN)]}
SHORT = ["--max_steps", "150", "--warmup_steps", "10"]  # the speedrun's steps
ABLATION = {  # one change at a time, each row adding to the one before
    "main job cut to 150 steps (AdamW, cosine, lr 2e-3)": SHORT,
    "+ Muon (--optimizer muon)": [*SHORT, "--optimizer", "muon"],
    "+ lr 4e-3": [*SHORT, "--optimizer", "muon", "--lr", "4e-3"],
    "+ warmup-stable-decay (the speedrun)": [*SHORT, "--optimizer", "muon", "--lr", "4e-3", "--schedule", "wsd"],
    "AdamW with the speedrun's lr and schedule": [*SHORT, "--lr", "4e-3", "--schedule", "wsd"],
    "the speedrun cut to 130 steps": ["--config", str(SPEEDRUN), "--max_steps", "130"],
}


def cpu_name() -> str:
    try: return next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration): return platform.processor() or platform.machine()


def train_seconds(metrics) -> float:
    "The seconds the optimizer steps took: each train record's tokens over its window's rate, summed."
    seconds, tokens = 0.0, 0
    for r in metrics["train"]:
        seconds += (r["tokens"] - tokens) / r["tokens_per_s"]
        tokens = r["tokens"]
    return seconds


def median_round(runs) -> dict:
    "The run of median perplexity (of an odd number: the target itself)."
    return sorted(runs, key=lambda r: r["perplexity"])[(len(runs) - 1) // 2]


def run(flags, out, timeout=1800) -> dict:
    "One trainer run of `flags` into `out`: steps, training and wall seconds, final validation perplexity."
    from distcourse.tracking import read_metrics
    cmd = [sys.executable, "-m", "distcourse.train", *flags, "--eval_every", "0", "--tracker", "none",
           "--output_dir", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode: raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    summary, metrics = json.loads((Path(out) / "run.json").read_text()), read_metrics(out)
    return {"max_steps": summary["config"]["max_steps"], "train_s": train_seconds(metrics), "wall_s": wall,
            "perplexity": summary["final"]["perplexity"], "choices": summary["choices"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the main job and the speedrun")
    p.add_argument("--no-ablation", dest="ablation", action="store_false", help="skip the one-change-at-a-time rows")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "speedrun.json"))
    a = p.parse_args(argv)
    tmp, runs = Path(tempfile.mkdtemp(prefix="speedrun-")), {name: [] for name in RECIPES}
    def contender(name):
        def go():
            r = run(RECIPES[name], tmp / f"{name.replace(' ', '_')}{len(runs[name])}")
            runs[name].append(r)
            print(f"{name:9}: {r['max_steps']} steps, {r['train_s']:6.1f} s training, {r['wall_s']:6.1f} s wall, "
                  f"perplexity {r['perplexity']:.1f}", flush=True)
            return r["train_s"]
        return go
    seconds, order = rounds({name: contender(name) for name in RECIPES}, a.rounds)
    main_job, speed = runs["main job"], runs["speedrun"]
    reached = all(s["perplexity"] <= m["perplexity"] for m, s in zip(main_job, speed))
    result = {
        "measured": (f"Measured {date.today()} on {cpu_name()} ({os.cpu_count()} cores), {len(main_job)} rounds, "
                     "by `python benchmarks/speedrun.py`"),
        "rounds": {"order": order, **runs}, "reached": reached,
        "paired": paired(seconds["main job"], seconds["speedrun"]),
        "paired_wall": paired([m["wall_s"] for m in main_job], [s["wall_s"] for s in speed]),
        "target": statistics.median(m["perplexity"] for m in main_job), "ablation": []}
    print(summary_line("training seconds, main job / speedrun", result["paired"]))
    print(summary_line("whole command, main job / speedrun", result["paired_wall"]))
    print(f"every round's speedrun reached that round's main-job perplexity: {reached}")
    rows = {"main job (450 steps)": None, **ABLATION} if a.ablation else {}
    for i, (name, flags) in enumerate(rows.items()):
        if flags is None: r = {**median_round(main_job), "note": "its round of median perplexity (the target)"}
        else: r = run(flags, tmp / f"ablation{i}")
        result["ablation"].append({"name": name, "flags": " ".join(flags or []), **r})
        print(f"{name:52} {r['max_steps']:4} steps {r['train_s']:6.1f} s {r['perplexity']:8.1f}", flush=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
