"""Two runs of the same paired measurement side by side: each ratio's median, spread and pairs, and how far apart
the two medians are. Writes compare.md next to this file.

    python benchmarks/paired_runs/compare.py run1 run2   # directories holding a results.json each
"""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(name) -> dict:
    return json.loads((HERE / name / "results.json").read_text())


def main(names):
    runs = [load(n) for n in names]
    lines = ["Runs: " + "; ".join(f"{n}: `{r['command']}`, {r['date']}, {r['device']}, {r['wall_s']:.0f} s, "
                                  f"load average {r['load_average']['start']:.1f} → {r['load_average']['end']:.1f}"
                                  for n, r in zip(names, runs)), "",
             "| ratio | " + " | ".join(f"{n}: median (min–max, pairs)" for n in names) + " | apart |",
             "|---|" + "---|" * len(names) + "---|"]
    for k in runs[0]["paired"]:
        cells = [f"{r['paired'][k]['ratio']:.3f} ({r['paired'][k]['min']:.3f}–{r['paired'][k]['max']:.3f}, "
                 f"{r['paired'][k]['pairs']})" if k in r["paired"] else "—" for r in runs]
        meds = [r["paired"][k]["ratio"] for r in runs if k in r["paired"]]
        apart = f"{max(meds) / min(meds) - 1:.1%}" if len(meds) > 1 else "—"
        lines.append(f"| `{k}` | " + " | ".join(cells) + f" | {apart} |")
    if all("time_to_loss" in r for r in runs):
        lines += ["", "| time to the same validation loss | " + " | ".join(names) + " |",
                  "|---|" + "---|" * len(names)]
        t = [r["time_to_loss"] for r in runs]
        for label, f in (("target loss", lambda x: f"{x['target_loss']:.3f}"),
                         ("distcourse defaults: seconds (step)", lambda x: f"{x['distcourse']['seconds']:.1f} "
                                                                      f"({x['distcourse']['step']:.1f})"),
                         ("transformers.Trainer fp32 eager: seconds (step)", lambda x: f"{x['hf_trainer']['seconds']:.1f} "
                                                                                  f"({x['hf_trainer']['step']:.1f})"),
                         ("ratio (Trainer seconds ÷ distcourse seconds)", lambda x: f"{x['ratio']:.3f}"),
                         ("steps ratio × paired per-step ratio", lambda x: f"{x['paired_estimate']:.3f}")):
            lines.append(f"| {label} | " + " | ".join(f(x) for x in t) + " |")
    (HERE / "compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__": main(sys.argv[1:] or ["run1", "run2"])
