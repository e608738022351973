"""The README's figure: one model trained three ways on the same global batch of 8 sequences per step:
1 process x 8 sequences, 2 processes x 4, and 1 process x 4 sequences x 2 accumulation steps. Real runs of the
course's `train`, started by its `launch` (2 gloo processes on a CPU), drawn into one loss plot.

    python docs/signature.py                 # about a minute on 2 CPU cores; writes docs/signature.png
    python docs/signature.py --steps 20 --out /tmp/sig.png
"""
import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from distcourse.config import Config  # noqa: E402
from distcourse.launch import launch  # noqa: E402
from distcourse.train import train  # noqa: E402

HERE = Path(__file__).resolve().parent
LAYOUTS = {"1 × 8": (1, 8, 1), "2 × 4": (2, 4, 1), "1 × 4 × 2": (1, 4, 2)}  # processes, batch, accumulation


def losses(out: Path) -> dict:
    "{step: training loss} of a run's metrics.jsonl."
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r.get("split", "train") == "train" and "loss" in r}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    p.add_argument("--out", default=str(HERE / "signature.png"), help="the PNG to write")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="signature-"))
    base = Config(model="tiny", seq_len=64, lr=3e-3, warmup_steps=5, max_steps=args.steps, eval_every=0,
                  log_every=1, max_examples=1000, mixed_precision="no", compile="false")  # fp32, eager: exact
    curves = {}
    for name, (n, batch, accum) in LAYOUTS.items():
        out = tmp / name.replace(" × ", "x")
        cfg = replace(base, batch_size=batch, grad_accum=accum, output_dir=str(out))
        launch(train, (cfg,), num_processes=n, timeout=600)
        curves[name] = losses(out)
    ref = curves["1 × 8"]
    gap = max(abs(c[s] - ref[s]) / abs(ref[s]) for c in curves.values() for s in ref)
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    for (name, c), style in zip(curves.items(), [dict(lw=5, alpha=0.35), dict(ls="--", lw=1.5), dict(ls=":", lw=2)]):
        ax.plot(list(c), list(c.values()), label=f"{name}", **style)
    ax.set(xlabel="optimizer step", ylabel="training loss",
           title=f"processes × batch (× accumulation), 8 sequences a step: largest gap {gap:.0e} relative")
    ax.title.set_fontsize(9)
    ax.legend(title="layout")
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"{args.out}: {Path(args.out).stat().st_size / 1e3:.0f} kB; {args.steps} steps, "
          f"final losses {', '.join(f'{k} {c[max(c)]:.4f}' for k, c in curves.items())}; largest gap {gap:.1e}")


if __name__ == "__main__":
    main()
