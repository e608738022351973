"""The planner's shared-CPU model against the trainer's own runs: mean error of step time and memory per rank, and
the regret of its top-1 and top-3 choices, at each world size of each `benchmarks/layouts*.json`, into
`benchmarks/plan_validation.json` (lesson 09c reads it; issue 41).

    python benchmarks/plan_validation.py    # seconds: reads the runs and benchmarks/plan_profile.json

Two files, two roles. `layouts.json` (`small`, 4 layers, 8 x 64 tokens) is the shape the model was built and
checked against while it was written (lesson 09c, 2026-11-27 and 28): a development set. `layouts_heldout.json`
(`tiny`, 4 layers, 16 x 128 tokens) was measured after the model was last changed and never used to change it:
the held-out set. The model has no fitted parameter; the profile it reads comes from 09b's microbenchmarks alone.

Regret: the planner ranks the measured layouts of one world size (plan()'s order: printed step time, then the
fullest rank's memory); top-1 regret is the measured step of its first choice over the fastest measured, minus 1;
top-3 regret the same for the fastest measured among its first three.
"""
import json
import statistics
from dataclasses import fields
from datetime import datetime, timezone
from pathlib import Path

from distcourse.machine import load_profile
from distcourse.planner import Layout, memory, predict, printed_ms
from distcourse.sizes import shape_of

HERE = Path(__file__).resolve().parent
FILES = {"layouts.json": "development", "layouts_heldout.json": "held out"}


def as_layout(d) -> Layout:
    "A Layout from a layouts.json run's layout (None where an axis is unused)."
    names = {f.name for f in fields(Layout)}
    return Layout(**{k: v for k, v in d.items() if k in names and v is not None})


def spearman(x, y) -> float:
    "Spearman's rank correlation (ties get their mean rank)."
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for i, k in enumerate(order): r[k] = i
        return [statistics.mean(r[j] for j in range(len(v)) if v[j] == v[k]) for k in range(len(v))]
    rx, ry = ranks(list(x)), ranks(list(y))
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def rows_of(measured, p) -> list:
    "Each run the trainer accepted and timed, beside the planner's prediction of it."
    m, out = measured["model"], []
    s = shape_of(m["preset"], m.get("n_layer", 0), m.get("vocab_size", 8192))
    for run in measured["runs"]:
        if run.get("refused") or not run.get("step_s"): continue
        L = as_layout(run["layout"])
        got, seq = predict(s, L, measured["seq_len"], p), measured["seq_len"]
        pred = [memory(s, L, seq, p.dtype, r // (L.world // L.pp))["first_step"] for r in range(L.world)]
        peaks = run.get("peak_bytes") or []
        out.append({"world": run["world"], "layout": str(L), "step_s": run["step_s"], "pred_s": got["step_s"],
                    "order": (printed_ms(got), max(pred)), "mem_errors": [a / b - 1 for a, b in zip(pred, peaks) if b]})
    return out


def summary(rows) -> dict:
    "Mean errors, rank correlation and regrets of one world size's rows."
    best = min(r["step_s"] for r in rows)
    ranked = sorted(rows, key=lambda r: (r["order"], r["layout"]))
    mem = [abs(e) for r in rows for e in r["mem_errors"]]
    errors = [abs(r["pred_s"] / r["step_s"] - 1) for r in rows]
    return {"layouts": len(rows), "step_mean_abs_error": statistics.mean(errors),
            "step_pred_over_measured_median": statistics.median(r["pred_s"] / r["step_s"] for r in rows),
            "rho": spearman([r["step_s"] for r in rows], [r["pred_s"] for r in rows]),
            "memory_mean_abs_error": statistics.mean(mem) if mem else None, "memory_ranks": len(mem),
            "first_choice": ranked[0]["layout"], "top1_regret": ranked[0]["step_s"] / best - 1,
            "top3_regret": min(r["step_s"] for r in ranked[:3]) / best - 1,
            "fastest_measured": min(rows, key=lambda r: r["step_s"])["layout"]}


def main():
    p = load_profile("measured")
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": "python benchmarks/plan_validation.py", "profile": p.source, "files": {}}
    for name, role in FILES.items():
        path = HERE / name
        if not path.exists(): continue
        measured = json.loads(path.read_text())
        rows = rows_of(measured, p)
        out["files"][name] = {"role": role, "measured": measured["date"], "machine": measured["machine"],
                              "model": measured["model"], "seq_len": measured["seq_len"],
                              "global_batch": measured["global_batch"],
                              "worlds": {str(w): summary([r for r in rows if r["world"] == w])
                                         for w in sorted({r["world"] for r in rows}, reverse=True) if w > 1}}
    (HERE / "plan_validation.json").write_text(json.dumps(out, indent=1) + "\n")
    for name, f in out["files"].items():
        for w, s in f["worlds"].items():
            print(f"{name:<22} {f['role']:<12} world {w}: {s['layouts']} layouts, step error "
                  f"{s['step_mean_abs_error']:.0%} (median pred/meas {s['step_pred_over_measured_median']:.2f}), "
                  f"rho {s['rho']:.2f}, memory error {s['memory_mean_abs_error']:.1%}, top-1 regret "
                  f"{s['top1_regret']:.0%}, top-3 {s['top3_regret']:.0%}")


if __name__ == "__main__":
    main()
