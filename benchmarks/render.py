"""The benchmark tables, rendered from a results.json: results.md, and the marked parts of
RESULTS.md and docs/benchmarks.md.

    python benchmarks/render.py            # rewrite them from benchmarks/results.json
    python benchmarks/render.py --check    # exit 1, naming the file, if one differs from the render

Every number in those tables comes from results.json, and every "met" from TARGETS below: a table
edited by hand fails `--check` (tests/test_benchmarks.py runs it). Imports nothing heavy.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
MAIN_JOB_SHAPE = (16, 128)  # batch size, sequence length of the main job: what `--paths` measures

# metric -> (comparison, threshold); each metric is a ratio of two numbers measured in one run
TARGETS = {
    "loop_vs_torch": (">=", 0.97),                   # the course's step ÷ a hand-written torch loop
    "loop_vs_hf_trainer": (">=", 1.1),               # ... ÷ transformers.Trainer, same optimizer
    "processes_vs_threads": (">=", 0.9),             # 2 processes x 1 thread ÷ 1 x 2 threads, same cores
    "main_job_vs_best_path": (">=", 0.95),           # the trainer's defaults ÷ the fastest path
    "defaults_vs_hf_trainer_defaults": (">=", 2.0),  # the trainer's defaults ÷ the Trainer's
    "matched_vs_hf_trainer": (">=", 0.97),           # the same, both on bf16 + torch.compile
    "padding_waste_packing": ("==", 0.0),            # packed blocks hold no padding
}
PATH_TARGET = "loop_vs_torch"  # each fp32/bf16 x eager/compile path is held to this metric's bar


def value(res: dict, metric: str):
    "The measured value of a target's metric in a result (None: not measured in that run)."
    if metric == "padding_waste_packing": return res["padding_waste"]["packing"]
    return res.get(metric)


def met(metric: str, x):
    "Whether value `x` meets `metric`'s target (None when not measured)."
    if metric not in TARGETS:
        raise KeyError(f"no target for {metric!r}: add it to TARGETS in benchmarks/render.py")
    if x is None: return None
    comparison, threshold = TARGETS[metric]
    return x >= threshold if comparison == ">=" else x == threshold


def bar(metric: str) -> str:
    comparison, threshold = TARGETS[metric]
    return f"{comparison} {threshold:g}"


def targets(res: dict) -> dict:
    "Each target: its value, the bar, and whether it is met (None: not measured in this run)."
    out = {}
    for metric in TARGETS:
        x = value(res, metric)
        out[metric] = {"value": x, "target": bar(metric), "met": met(metric, x)}
    return out


def yes_no(m) -> str:
    return "—" if m is None else "yes" if m else "no"


def num(x, digits=3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def row(*cells) -> str:
    "A Markdown table row; an empty cell is one space."
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def heading(res: dict) -> str:
    "One line: when, where, by which command, on what model and batch, under what load."
    c, load = res["config"], res["load_average"]
    compiled = ", torch.compile" if c["compile"] else ""
    return (f"Run {res['date']} on {res['device']}, `{res['command']}` ({res['wall_s']:.0f} s). "
            f"Model `{c['model']}` ({c['num_params'] / 1e6:.1f}M parameters), "
            f"batch {c['batch_size']} x {c['seq_len']} tokens, {c['precision']}{compiled}, "
            f"{res['threads']['torch']} threads; "
            f"load average {load['start']:.1f} at the start, {load['end']:.1f} at the end.")


def collectives(rows: list) -> list:
    "The collectives measured, in the order they were measured."
    names = []
    for r in rows:
        if r["collective"] not in names: names.append(r["collective"])
    return names


def padding(res: dict) -> str:
    pw = res["padding_waste"]
    return f"{pw['fixed']:.1%} / {pw['dynamic']:.1%} / {pw['packing']:.1%}"


def paths_table(res: dict) -> list:
    "Each fp32/bf16 x eager/compile path, the main job, and the Trainer on two of them."
    batch, seq = res.get("job_shape", MAIN_JOB_SHAPE)
    header = row(f"path ({batch} x {seq})", "torch tokens/s", "distcourse tokens/s",
                 "loop_vs_torch", "met")
    lines = ["", header, "|---|---|---|---|---|"]
    for k, v in res["paths"].items():
        tps, ratio = v["tokens_per_s"], v["loop_vs_torch"]
        lines.append(row(k, f"{tps['torch']:,.0f}", f"{tps['distcourse']:,.0f}", f"{ratio:.3f}",
                         yes_no(met(PATH_TARGET, ratio))))
    mj = res["main_job"]
    lines.append(row(f"the main job's defaults ({mj['mixed_precision']}, compile)", "",
                     f"{mj['tokens_per_s']:,.0f}", "", ""))
    for k in ("fp32 eager", "bf16 compile"):
        trainer = res["paths"][k]["tokens_per_s"]["hf_trainer"]
        lines.append(row(f"transformers.Trainer, {k}", f"{trainer:,.0f}", "", "", ""))
    return lines


def comm_table(res: dict) -> list:
    "Latency of the smallest and bus bandwidth of the largest message, per collective and world."
    lines = ["", "| collective | world | latency, smallest (µs) | bus bandwidth, largest (GB/s) |",
             "|---|---|---|---|"]
    for n, rows in res["comm"].items():
        for c in collectives(rows):
            mine = [r for r in rows if r["collective"] == c]
            latency, busbw = mine[0]["seconds"] * 1e6, mine[-1]["busbw"] / 1e9
            lines.append(row(c, n, f"{latency:,.0f}", f"{busbw:.2f}"))
    ddp = res.get("ddp") or {}
    if "allreduce_predicted_s" in ddp:
        mb, ms = ddp["allreduce_bytes"] / 1e6, ddp["allreduce_s"] * 1e3
        predicted_ms = ddp["allreduce_predicted_s"] * 1e3
        lines += ["", f"DDP's all-reduce of every gradient ({mb:.1f} MB, 2 processes): measured "
                      f"{ms:.1f} ms, predicted from this table {predicted_ms:.1f} ms (lesson 03a); "
                      "the plot is comm.png"]
    return lines


def tp_table(res: dict) -> list:
    "Tokens/s at tp 1 and tp 2 and the share of the tp-2 step in its all-reduces."
    tp, m = res["tp"], res["tp"]["size"]["model"]
    tps, threads = tp["tokens_per_s"], tp["threads"]
    counted = (f"{tp['tp2_comm_fraction']:.1%} ({tp['all_reduces_per_step']:.0f} all-reduces "
               f"per step, {tp['all_reduces_predicted']} predicted)")
    size = tp["size"]
    return ["", f"Tensor parallelism (lesson 05c's layers), GPT {m['n_layer']} x {m['n_embd']}, "
                f"batch {size['batch_size']} x {size['seq_len']}, fp32; no target on a CPU:",
            "", "| tp | threads per process | tokens/s | share of the step in TP all-reduces |",
            "|---|---|---|---|",
            row(1, threads["tp1"], f"{tps['tp1']:,.0f}", "—"),
            row(2, threads["tp2"], f"{tps['tp2']:,.0f}", counted)]


def table(res: dict) -> str:
    "The Markdown tables of a result (results.md, and RESULTS.md's measured part)."
    lines = [heading(res), "", "| metric | value | target | met |", "|---|---|---|---|"]
    for metric in TARGETS:
        x = value(res, metric)
        lines.append(row(f"`{metric}`", num(x), bar(metric), yes_no(met(metric, x))))
    peak = (f"{res['mm_utilisation']:.1%} of the measured matmul rate, {res['peak_flops'] / 1e9:,.1f} GFLOP/s "
            "(model FLOPs over a measured rate, not over the hardware's datasheet peak: not MFU)")
    lines += [row("`padding_waste` fixed / dynamic / packing", padding(res), "", ""),
              row("`data_tokens_per_s` (tokenize + pack)", f"{res['data_tokens_per_s']:,.0f}", "",
                  ""),
              *scaling_rows(res), row("`mm_utilisation` (distcourse)", peak, "", ""), *mfu_row(res),
              "", "| contender | tokens/s (median) | IQR | model FLOPs / matmul rate |", "|---|---|---|---|"]
    for k, v in res["tokens_per_s"].items():
        lo, hi = res["tokens_per_s_iqr"][k]
        mm = res["mm_utilisation_by_contender"][k]
        lines.append(row(k, f"{v:,.0f}", f"{lo:,.0f}–{hi:,.0f}", f"{mm:.1%}"))
    if res["ddp"]:
        for k, v in res["ddp"]["tokens_per_s"].items():
            lines.append(row(f"distcourse, {k} (ddp)", f"{v:,.0f}", "", ""))
    if res.get("paired"): lines += paired_table(res)
    if res.get("paths"): lines += paths_table(res)
    if res.get("time_to_loss"): lines += time_to_loss_table(res)
    if res.get("comm"): lines += comm_table(res)
    if res.get("tp"): lines += tp_table(res)
    if res.get("memory"): lines += memory_table(res)
    if res.get("overlap"): lines += overlap_table(res)
    return "\n".join(lines) + "\n"


def paired_table(res: dict) -> list:
    "Each ratio as the median of its per-pair ratios (the order alternating), with their spread."
    lines = ["", "Ratios, each the median over pairs timed in alternating order (steps taking turns; the main job: "
             "rounds of whole runs):", "", "| ratio | median | min | max | pairs |", "|---|---|---|---|---|"]
    for k, v in res["paired"].items():
        lines.append(row(f"`{k}`", *(f"{v[x]:.3f}" for x in ("ratio", "min", "max")), v["pairs"]))
    if res.get("rounds"):
        r = res["rounds"]
        lines += ["", f"The rounds ({len(r['order'])}, the order alternating: {', '.join(r['order'][0])}; then reversed):",
                  "", "| contender | tokens/s, each round | median |", "|---|---|---|"]
        for k, v in r["tokens_per_s"].items():
            lines.append(row(k, " / ".join(f"{x:,.0f}" for x in v), f"{statistics.median(v):,.0f}"))
    return lines


def time_to_loss_table(res: dict) -> list:
    "Training seconds to the same validation loss: the trainer's defaults against transformers.Trainer's."
    ttl = res["time_to_loss"]
    batch, seq = ttl["shape"]
    lines = ["", f"Time to the same validation loss ({ttl['target_loss']:.3f}, the worse of the two after "
                 f"{ttl['steps']} steps of {batch} x {seq}; evaluated every {ttl['eval_every']} steps on the same "
                 "validation set, interpolated; training seconds, evaluation left out):", "",
             "| trainer | seconds | step | final loss |", "|---|---|---|---|"]
    for k, what in (("distcourse", "distcourse.train, its defaults"), ("hf_trainer", "transformers.Trainer, fp32 eager")):
        v = ttl[k]
        lines.append(row(what, num(v["seconds"], 1), num(v["step"], 1), f"{v['curve'][-1][2]:.3f}"))
    estimate = ttl.get("paired_estimate")
    lines += ["", f"`defaults_time_to_loss_vs_hf_trainer` {num(ttl['ratio'])} (one pair of runs); steps to the loss "
                  f"{num(ttl['steps_ratio'])} x the paired per-step ratio: {num(estimate)}"]
    return lines


def overlap_table(res: dict) -> list:
    "DDP's exposed communication on 2 processes (lesson 03b): measured from each rank-0 trace."
    lines = ["", "DDP on 2 processes, communication not hidden by backward (lesson 03b's traces, rank 0, medians):", "",
             "| gradients all-reduced | exposed share | exposed ms | communication ms | step ms |", "|---|---|---|---|---|"]
    for k, o in res["overlap"].items():
        lines.append(row(k, f"{o['exposed_fraction']:.0%}", *(f"{1e3 * o[x]:.1f}" for x in ("exposed_s", "comm_s", "step_s"))))
    return lines


def memory_table(res: dict) -> list:
    "Each trainer's measured peak bytes of one step (PeakMemory) beside the memory model's (lesson 05)."
    lines = ["", "Memory of one step, bytes: measured peak by category (lesson 05's `PeakMemory`) / predicted "
             "(fp32 weights and gradients, `adamw_peak_bytes`):", "",
             "| trainer | PARAM | GRAD | OPT | ACT | TEMP |", "|---|---|---|---|---|---|"]
    for k, m in res["memory"].items():
        p, want = m["peak"], m["predicted"]
        lines.append(row(k, *(f"{p[c]:,} / {want[c]:,}" for c in ("PARAM", "GRAD", "OPT")),
                         f"{p['ACT']:,}", f"{p['TEMP']:,}"))
    return lines


def scaling_rows(res: dict) -> list:
    "Weak and strong scaling efficiency, each with its batch and hardware; none where not measured."
    return [row(f"`{k}` ({res[k]['what']})", num(res[k]["value"]), "", "")
            for k in ("weak_scaling", "strong_scaling") if res.get(k)]


def processes_vs_threads(res: dict) -> str:
    "What `processes_vs_threads` compares, in words."
    if not res.get("ddp"): return "(2 processes ÷ 1 on the same cores: not scaling)"
    return (f"(2 processes ÷ 1, both on the same {res['threads']['cores']} cores, global batch "
            f"{res['ddp']['bench']['batch_size']}: not scaling)")


def mfu_row(res: dict) -> list:
    "MFU's row: model FLOPs/s over the GPU's datasheet peak; none where no datasheet peak is known (a CPU)."
    if res.get("mfu") is None: return []
    p = res["peak"]
    return [row("`mfu` (distcourse)", f"{res['mfu']:.1%} of the {p['card']}'s datasheet "
                f"{p['datasheet_flops_per_s'] / 1e12:,.1f} dense bf16 TFLOP/s", "", "")]


def results_section(res: dict) -> str:
    "RESULTS.md's measured part: the versions, then the tables."
    v = res["versions"]
    names = ("python", "torch", "transformers", "accelerate", "datasets", "tokenizers")
    versions = ", ".join(f"{k} {v[k]}" for k in names if k in v)
    return f"Versions: {versions}.\n\n" + table(res)


def target_row(res: dict, metric: str, what: str, detail: str = "") -> str:
    "A docs/benchmarks.md row for one target: its value (with `detail`), its bar and whether it is met."
    x = value(res, metric)
    return row(f"`{metric}` {what}".strip(), num(x) + detail, bar(metric), yes_no(met(metric, x)))


def readme_paths(res: dict) -> list:
    "docs/benchmarks.md's rows for the four paths, the main job and the Trainer's defaults."
    batch, seq = MAIN_JOB_SHAPE
    names = list(res["paths"])
    ratios = [res["paths"][k]["loop_vs_torch"] for k in names]
    missed = [f"{k} {x:.3f}" for k, x in zip(names, ratios) if not met(PATH_TARGET, x)]
    verdict = f"{len(ratios) - len(missed)} of {len(ratios)}"
    if missed: verdict += f" (missed: {', '.join(missed)})"
    rows = [row(f"`loop_vs_torch` {' / '.join(names)} ({batch} × {seq})",
                " / ".join(f"{x:.3f}" for x in ratios), bar(PATH_TARGET), verdict)]
    best = max(v["tokens_per_s"]["distcourse"] for v in res["paths"].values())
    job = res["main_job"]["tokens_per_s"]
    trainer = res["paths"]["fp32 eager"]["tokens_per_s"]["hf_trainer"]
    spread = {k: "" for k in ("main_job_vs_best_path", "defaults_vs_hf_trainer_defaults", "matched_vs_hf_trainer")}
    if res.get("rounds"):  # medians of the rounds, and each ratio's spread over its pairs
        best, _, trainer = (statistics.median(v) for v in res["rounds"]["tokens_per_s"].values())
        spread = {k: f"; {p['min']:.3f}–{p['max']:.3f} over {p['pairs']} pairs" for k, p in res["paired"].items()}
    rows.append(target_row(res, "main_job_vs_best_path",
                           "(the trainer with its defaults ÷ the fastest path)",
                           f" ({job:,.0f} vs {best:,.0f} tokens/s{spread['main_job_vs_best_path']})"))
    rows.append(target_row(res, "defaults_vs_hf_trainer_defaults",
                           "(tokens/s; the Trainer in fp32, eager)",
                           f" ({job:,.0f} vs {trainer:,.0f} tokens/s{spread['defaults_vs_hf_trainer_defaults']})"))
    matched = spread["matched_vs_hf_trainer"].lstrip("; ")
    rows.append(target_row(res, "matched_vs_hf_trainer", "(bf16 + compile on both)", f" ({matched})" if matched else ""))
    if res.get("time_to_loss"):
        ttl = res["time_to_loss"]
        rows.append(row("`defaults_time_to_loss_vs_hf_trainer` (training seconds to the same validation loss, "
                        f"{ttl['target_loss']:.2f})", f"{num(ttl['ratio'])} ({ttl['distcourse']['seconds']:.0f} vs "
                        f"{ttl['hf_trainer']['seconds']:.0f} s; steps to it × paired per-step ratio: "
                        f"{num(ttl.get('paired_estimate'))})", "", ""))
    return rows


def readme_section(res: dict) -> str:
    "docs/benchmarks.md's benchmark table: the targets first, then what else the run measured."
    c = res["config"]
    shape = f"({c['precision']}, {c['batch_size']} × {c['seq_len']})"
    took = f"{res['wall_s']:.0f} s"
    if "paths" in res["section_s"]:
        took += f", of which `--paths` {res['section_s']['paths']:.0f} s"
    rows = [f"Last run: `{res['command']}` on {res['date'][:10]} ({took}), {res['device']}, the "
            f"`{c['model']}` preset; the table is rendered from `benchmarks/results.json` by "
            "`python benchmarks/render.py`.", "",
            "| metric | value | target | met |", "|---|---|---|---|",
            target_row(res, "loop_vs_torch", shape)]
    if res.get("paths"): rows += readme_paths(res)
    x = value(res, "loop_vs_hf_trainer")
    verdict = yes_no(met("loop_vs_hf_trainer", x))
    if verdict == "no":
        verdict += (f": the Trainer itself runs at {res['hf_trainer_vs_torch']:.3f} × a bare "
                    "loop's speed here ([why](../benchmarks/RESULTS.md#targets))")
    rows.append(row(f"`loop_vs_hf_trainer` {shape}", num(x), bar("loop_vs_hf_trainer"), verdict))
    rows.append(target_row(res, "processes_vs_threads", processes_vs_threads(res)))
    rows += scaling_rows(res)
    packing = met("padding_waste_packing", value(res, "padding_waste_packing"))
    rows.append(row("`padding_waste` fixed / dynamic / packing", padding(res),
                    f"packing {bar('padding_waste_packing')}", yes_no(packing)))
    rows.append(row("`data_tokens_per_s` (tokenize + pack)", f"{res['data_tokens_per_s']:,.0f}", "",
                    ""))
    peak = (f"{res['mm_utilisation']:.1%} of {res['peak_flops'] / 1e9:,.1f} GFLOP/s, a *measured* "
            f"{c['precision']} matmul rate (not a datasheet peak, so not MFU)")
    rows += [row("`mm_utilisation`", peak, "", ""), *mfu_row(res)]
    if res.get("comm"):
        cells = []
        for rows_n in res["comm"].values():
            mine = [q for q in rows_n if q["collective"] == "all_reduce"]
            cells.append(f"{mine[0]['seconds'] * 1e6:,.0f} µs, {mine[-1]['busbw'] / 1e9:.2f} GB/s")
        worlds = " / ".join(res["comm"])
        rows.append(row(f"gloo all-reduce, {worlds} processes: latency of the smallest, "
                        "bus bandwidth of the largest", " / ".join(cells), "", ""))
    if res.get("tp"):
        tp, m = res["tp"], res["tp"]["size"]["model"]
        tps, threads = tp["tokens_per_s"], tp["threads"]
        rows.append(row(f"tensor parallel (lesson 05c), GPT {m['n_layer']} × {m['n_embd']}: "
                        f"tp 1 × {threads['tp1']} threads / tp 2 × {threads['tp2']} thread",
                        f"{tps['tp1']:,.0f} / {tps['tp2']:,.0f} tokens/s; "
                        f"{tp['tp2_comm_fraction']:.1%} of the tp-2 step in its "
                        f"{tp['all_reduces_per_step']:.0f} all-reduces "
                        f"({tp['all_reduces_predicted']} predicted)", "", ""))
    return "\n".join(rows) + "\n"


def replace_marked(text: str, section: str, name: str) -> str:
    "`text` with what lies between the markers replaced by `section`."
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{name} needs one {BEGIN} line, then one {END} line, around the "
                         "generated table; put them back around it")
    head, rest = text.split(BEGIN)
    tail = rest.split(END)[1]
    return f"{head}{BEGIN}\n{section}{END}{tail}"


def rendered(res: dict, root: Path = ROOT) -> dict:
    "What each generated file under `root` should hold: path -> text."
    readme, doc = root / "docs" / "benchmarks.md", root / "benchmarks" / "RESULTS.md"
    return {root / "benchmarks" / "results.md": table(res),
            doc: replace_marked(doc.read_text(), results_section(res), "benchmarks/RESULTS.md"),
            readme: replace_marked(readme.read_text(), readme_section(res), "docs/benchmarks.md")}


def stale(res: dict, root: Path = ROOT) -> list:
    "The generated files under `root` that differ from what `res` renders to."
    return [path for path, text in rendered(res, root).items() if path.read_text() != text]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=str(HERE / "results.json"),
                   help="the results.json to render")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs")
    args = p.parse_args(argv)
    res = json.loads(Path(args.results).read_text())
    differ = [str(path.relative_to(ROOT)) for path in stale(res)]
    if args.check:
        if differ:
            sys.exit(f"{', '.join(differ)} differ from what {args.results} renders to: run "
                     "`python benchmarks/render.py` and commit the result (never edit those tables "
                     "by hand)")
        print("up to date: benchmarks/results.md, benchmarks/RESULTS.md, docs/benchmarks.md")
        return
    for path, text in rendered(res).items(): path.write_text(text)
    print("rewrote: " + (", ".join(differ) or "nothing (already up to date)"))


if __name__ == "__main__": main()
