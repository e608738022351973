"""The trainer's three tasks side by side: processed tokens per second of clm, mlm and cls at the same batch,
length and precision, each a real `python -m distcourse.train` run, in alternating rounds (pairing.py).

    python benchmarks/bench_tasks.py                    # tiny, 8 x 64, fp32 eager, 30 steps, 4 rounds
    python benchmarks/bench_tasks.py --rounds 2 --steps 12 --out /tmp/tasks.json

A run's rate is the median of its steps' processed tokens per second (every non-padding input token; the meter's
`tokens_per_s`) after `--skip` warm-up steps. The ratios mlm/clm and cls/clm are medians of per-round ratios.
Writes `benchmarks/tasks.json` (the default --out) and prints a table.
"""
import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from pairing import paired, rounds, summary_line  # noqa: E402

TASKS = ("clm", "mlm", "cls")


def rate(task, args, out: Path) -> float:
    "One trainer run of `task`: the median processed tokens per second after the warm-up steps."
    cmd = [sys.executable, "-m", "distcourse.train", "--task", task, "--model", args.model, "--seq_len",
           str(args.seq_len), "--batch_size", str(args.batch_size), "--max_steps", str(args.steps), "--eval_every",
           "0", "--log_every", "1", "--mixed_precision", args.precision, "--compile", "false", "--tracker", "none",
           "--output_dir", str(out / task), "--overwrite"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if done.returncode: raise SystemExit(f"{task} failed:\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
    steps = [json.loads(line) for line in (out / task / "metrics.jsonl").read_text().splitlines()]
    rates = [s["tokens_per_s"] for s in steps if "tokens_per_s" in s][args.skip:]
    return statistics.median(rates)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--precision", default="no", help="the trainer's --mixed_precision (no: fp32)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of each run's median")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=str(HERE / "tasks.json"))
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-tasks-"))
    rates, order = rounds({t: (lambda t=t: rate(t, args, tmp)) for t in TASKS}, args.rounds)
    ratios = {f"{t}/clm": paired(rates[t], rates["clm"]) for t in ("mlm", "cls")}
    result = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor()
              or platform.machine(), "settings": vars(args) | {"out": None}, "rates": rates, "order": order,
              "ratios": ratios}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"processed tokens/s, {args.model} at {args.batch_size} x {args.seq_len}, {args.precision}, eager; "
          f"medians of steps {args.skip + 1}-{args.steps}, {args.rounds} alternating rounds")
    for t in TASKS:
        runs = ", ".join(f"{r:,.0f}" for r in rates[t])
        print(f"  {t}: {statistics.median(rates[t]):,.0f} (runs: {runs})")
    for name, r in ratios.items(): print("  " + summary_line(name, r))


if __name__ == "__main__":
    main()
