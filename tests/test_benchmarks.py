"""`benchmarks/run.py` runs end to end in its smallest form and writes every field; its speeds are not tested
(performance is reported as ratios in benchmarks/RESULTS.md, never asserted by a test). The benchmark table of
docs/benchmarks.md, RESULTS.md's and results.md are what the committed results.json renders to (`benchmarks/render.py`)."""
import importlib.util
import json
import math
import shutil
import statistics

import pytest

from conftest import PY, ROOT, run_cli
from distcourse.comm import TIMED

_spec = importlib.util.spec_from_file_location("render", ROOT / "benchmarks" / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)
_spec = importlib.util.spec_from_file_location("scaling", ROOT / "benchmarks" / "scaling.py")
scaling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scaling)
_spec = importlib.util.spec_from_file_location("pairing", ROOT / "benchmarks" / "pairing.py")
pairing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pairing)
RESULTS = json.loads((ROOT / "benchmarks" / "results.json").read_text())
GENERATED = ("docs/benchmarks.md", "benchmarks/RESULTS.md", "benchmarks/results.md")

RUN = [PY, str(ROOT / "benchmarks" / "run.py"), "--smoke"]
CONTENDERS = {"torch", "distcourse", "hf_trainer"}
# each paired ratio: whose rate over whose (res["step_s"]; processes_vs_threads: res["ddp"]["step_s"])
SIDES = {"loop_vs_torch": ("distcourse", "torch"), "loop_vs_hf_trainer": ("distcourse", "hf_trainer"),
         "hf_trainer_vs_torch": ("hf_trainer", "torch"), "processes_vs_threads": ("2x1", "1x2")}


def number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = run_cli([*RUN, "--out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text(), out


def test_results_have_every_field(smoke):
    res = smoke[0]
    for k in ("loop_vs_torch", "loop_vs_hf_trainer", "processes_vs_threads", "data_tokens_per_s", "mm_utilisation",
              "peak_flops"):
        assert number(res[k]) and res[k] > 0, k
    # recomputed from the measured seconds: the matmul's FLOPs (2n³ a call; 20 calls a step on a GPU) over each
    # turn's seconds; a contender's model FLOPs per step (every contender a batch of batch_size × seq_len tokens)
    # over the same turn's matmul rate
    cfg, s = res["config"], res["step_s"]
    mm_flops = 2 * cfg["matmul_n"] ** 3 * (20 if res["device"].startswith("cuda") else 1)
    peak = statistics.median(mm_flops / t for t in s["matmul"])
    assert res["peak_flops"] == pytest.approx(peak, rel=1e-9) and res["peak"]["flops_per_s"] == res["peak_flops"]
    step_flops = res["flops_per_token"] * cfg["batch_size"] * cfg["seq_len"]
    mm = {k: statistics.median(step_flops / t / (mm_flops / m) for t, m in zip(s[k], s["matmul"])) for k in CONTENDERS}
    assert res["mm_utilisation_by_contender"] == pytest.approx(mm, rel=1e-9)
    assert res["mm_utilisation"] == pytest.approx(mm["distcourse"], rel=1e-9)
    assert res["mfu"] is None and res["peak"]["card"] is None  # a CPU: no datasheet peak, so no MFU
    assert set(res["tokens_per_s"]) == CONTENDERS and all(number(v) and v > 0 for v in res["tokens_per_s"].values())
    assert set(res["step_s"]) == CONTENDERS | {"matmul"}
    assert all(len(v) == res["config"]["steps"] for v in res["step_s"].values())  # warm-up steps left out
    assert set(res["ratios"]) == {"loop_vs_torch", "loop_vs_hf_trainer", "hf_trainer_vs_torch"}
    # every ratio: the median of its pairs (steps taking turns, the order alternating), with its spread
    assert set(res["paired"]) == set(res["ratios"]) | {"processes_vs_threads"}
    for k, p in res["paired"].items():  # recomputed from the turns' seconds: the same tokens a step on both sides
        turns = res["ddp"]["bench"]["steps"] if k == "processes_vs_threads" else res["config"]["steps"]
        s = res["ddp"]["step_s"] if k == "processes_vs_threads" else res["step_s"]
        a, b = SIDES[k]
        per = [tb / ta for ta, tb in zip(s[a], s[b])]  # a's tokens/s over b's, turn by turn
        assert p["pairs"] == len(per) == turns, k
        assert [p["ratio"], p["min"], p["max"]] == pytest.approx([statistics.median(per), min(per), max(per)],
                                                                 rel=1e-9), k
        assert res[k] == pytest.approx(statistics.median(per), rel=1e-9), k
    assert isinstance(res["device"], str) and res["device"].startswith(("cpu", "cuda"))
    assert {"torch", "transformers", "accelerate", "datasets", "distcourse"} <= set(res["versions"])
    assert res["threads"]["torch"] >= 1 and res["config"]["model"] == "tiny"
    rows = res["comm"]["2"]  # the collectives lesson's measurement, 2 gloo processes
    assert {r["collective"] for r in rows} == set(TIMED) and all(r["seconds"] > 0 and r["busbw"] > 0 for r in rows)


def test_exposed_communication_of_ddp(smoke):
    "Lesson 03b's measurement of DDP's overlap, three ways: a share of the communication, read from traces."
    res, md = smoke[0], smoke[1]
    assert set(res["overlap"]) == {"no overlap", "one bucket", "2 MiB buckets"}
    for o in res["overlap"].values():
        assert 0 <= o["exposed_fraction"] <= 1 and 0 <= o["exposed_s"] <= o["comm_s"] and o["step_s"] > 0, o
    assert "communication not hidden by backward" in md


def test_memory_measured_beside_the_prediction(smoke):
    "Each trainer's step measured by PeakMemory: weights, gradients and AdamW equal lesson 05's terms."
    res, md = smoke[0], smoke[1]
    assert set(res["memory"]) == {"torch", "distcourse"}
    for name, m in res["memory"].items():
        assert m["peak"]["PARAM"] == 4 * res["config"]["num_params"], name  # tied weights once
        for k in ("PARAM", "GRAD", "OPT"): assert m["peak"][k] == m["predicted"][k], (name, k, m)
        assert m["peak"]["ACT"] > 0 and m["opt_terms"]["sqrt and denominator of one tensor"] > 0
    assert "Memory of one step" in md


def test_tensor_parallel_fields(smoke):
    "tp 1 and tp 2 both measured; the counted all-reduces per step are the 4 per block that lesson 05c proves."
    tp = smoke[0]["tp"]
    assert all(number(v) and v > 0 for v in tp["tokens_per_s"].values()) and set(tp["tokens_per_s"]) == {"tp1", "tp2"}
    assert tp["all_reduces_per_step"] == tp["all_reduces_predicted"] == 4 * tp["size"]["model"]["n_layer"]
    assert 0 < tp["tp2_comm_fraction"] < 1 and "Tensor parallelism" in smoke[1]


def test_padding_and_data_fields(smoke):
    res = smoke[0]
    pw = res["padding_waste"]
    assert pw["packing"] == 0                      # packed blocks hold no padding, by construction
    assert 0 <= pw["dynamic"] <= pw["fixed"] < 1   # a batch padded to its longest never exceeds seq_len
    data = res["data"]  # tokens packed over the median of the timed packings
    assert data["packed_tokens"] > 0 and len(data["pack_s"]) == 1  # smoke: one repeat
    want = data["packed_tokens"] / statistics.median(data["pack_s"])
    assert res["data_tokens_per_s"] == pytest.approx(want, rel=1e-12)
    assert data["data_tokens_per_s"] == res["data_tokens_per_s"]


def test_two_processes_were_one_gloo_group(smoke):
    ddp, cores = smoke[0]["ddp"], smoke[0]["threads"]["cores"]
    assert ddp["distributed_type"]["2x1"] == "MULTI_CPU" and ddp["distributed_type"]["1x2"] == "NO"  # one group
    per = [one / two for one, two in zip(ddp["step_s"]["1x2"], ddp["step_s"]["2x1"])]  # the same global batch
    assert ddp["processes_vs_threads"] == pytest.approx(statistics.median(per), rel=1e-9)
    assert len(ddp["step_s"]["2x1"]) == ddp["bench"]["steps"] and f"the same {cores} cores" in ddp["compared"]
    assert number(ddp["allreduce_s"]) and ddp["allreduce_s"] > 0
    # lesson 03a's prediction of that all-reduce from the bus-bandwidth table, beside it; the table drawn
    assert ddp["allreduce_bytes"] > 0 and ddp["allreduce_bytes"] % 4 == 0  # every fp32 gradient
    assert number(ddp["allreduce_predicted_s"]) and ddp["allreduce_predicted_s"] > 0
    assert "predicted from this table" in smoke[1] and (smoke[2] / "comm.png").stat().st_size > 0


def test_scaling_with_a_core_per_process(smoke):
    "1 process on 1 core against 2 on a core each: weak and strong scaling are the formulas on the measured steps."
    res, md = smoke[0], smoke[1]
    if res["threads"]["cores"] < 2: pytest.skip("one core: no twice the hardware to scale to")
    ddp, med = res["ddp"], {k: statistics.median(v) for k, v in res["ddp"]["step_s"].items()}
    assert ddp["distributed_type"] == {"1x2": "NO", "2x1": "MULTI_CPU", "1x1": "NO", "1x1_half_batch": "NO"}
    per_core = ddp["bench"]["batch_size"] // 2
    # weak: the same batch per core, so each process's step is the 1-core step: T_1 / T_2 of those runs
    assert math.isclose(res["weak_scaling"]["value"], med["1x1_half_batch"] / med["2x1"], rel_tol=1e-9)
    assert math.isclose(res["strong_scaling"]["value"], med["1x1"] / (2 * med["2x1"]), rel_tol=1e-9)
    assert f"batch {per_core} per core" in res["weak_scaling"]["what"]
    assert f"global batch {2 * per_core}" in res["strong_scaling"]["what"]
    assert all(f"`{k}` (" in md for k in ("weak_scaling", "strong_scaling"))


def run(devices, batch, tokens_per_s, seq_len=128, device="GPU"):
    "A constructed run whose seconds per step follow from its tokens/s."
    return scaling.Run(devices, batch, tokens_per_s, devices * batch * seq_len / tokens_per_s, device)


def test_weak_and_strong_scaling_formulas():
    "Weak: tokens/s_N ÷ (N × tokens/s_1) at a fixed batch per device; strong: T_1 ÷ (N × T_N) at a fixed global batch."
    one = run(1, 4, 1000.0)
    assert math.isclose(scaling.weak_scaling_efficiency(one, run(2, 4, 1800.0))["value"], 0.9)
    assert math.isclose(scaling.weak_scaling_efficiency(one, run(4, 4, 3200.0))["value"], 0.8)  # N, not 2
    # strong: 16 sequences in all; 1 GPU takes 2.048 s a step, 4 GPUs (4 each) 0.64 s: 2.048 / (4 x 0.64) = 0.8
    whole, four = run(1, 16, 1000.0), run(4, 4, 3200.0)
    assert (whole.step_s, four.step_s) == (2.048, 0.64)
    strong = scaling.strong_scaling_efficiency(whole, four)
    assert math.isclose(strong["value"], 0.8) and "global batch 16 (4 per GPU on 4)" in strong["what"]
    # these numbers tell the formulas apart: T_1 / (2 T_2) of the weak runs is 0.512 s / (2 x 0.569 s) = 0.45
    assert math.isclose(one.step_s / (2 * run(2, 4, 1800.0).step_s), 0.45)
    # each refuses the other's setting, and a baseline that is not one device
    with pytest.raises(ValueError, match="use strong_scaling_efficiency"):
        scaling.weak_scaling_efficiency(whole, four)
    with pytest.raises(ValueError, match="use weak_scaling_efficiency"):
        scaling.strong_scaling_efficiency(one, run(2, 4, 1800.0))
    with pytest.raises(ValueError, match="1-device run"):
        scaling.weak_scaling_efficiency(run(2, 4, 1800.0), four)
    with pytest.raises(ValueError, match="compare like devices"):
        scaling.weak_scaling_efficiency(run(1, 4, 1000.0, device="core"), run(2, 4, 1800.0))


def test_targets_and_markdown_table(smoke):
    res, md = smoke[0], smoke[1]
    assert set(res["targets"]) == set(render.TARGETS)
    with_paths = {"main_job_vs_best_path", "defaults_vs_hf_trainer_defaults", "matched_vs_hf_trainer"}
    for k, t in res["targets"].items():
        if k in with_paths: assert t["met"] is None, k  # measured only with --paths
        else: assert isinstance(t["met"], bool), k
        assert t["target"].startswith((">=", "==")), k
    assert "| metric | value | target | met |" in md and "| contender | tokens/s (median) |" in md
    assert all(f"`{k}`" in md for k in res["targets"]) and all(f"| {k} |" in md for k in CONTENDERS)


def test_parts_can_be_left_out_and_paths_added(tmp_path):
    proc = run_cli([*RUN, "--no_ddp", "--no_hf", "--no_comm", "--no_tp", "--no_overlap", "--paths",
                    "--out", str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["paths"]) == {"fp32 eager", "fp32 compile", "bf16 eager", "bf16 compile"}
    for name, v in res["paths"].items():  # the Trainer too on its default path (fp32 eager) and the course's
        with_hf = name in ("fp32 eager", "bf16 compile")
        assert number(v["loop_vs_torch"]), name
        assert set(v["tokens_per_s"]) == {"torch", "distcourse"} | ({"hf_trainer"} if with_hf else set()), name
    # the main job in 2 rounds against the fastest path and the Trainer's defaults, the order alternating
    best = max(res["paths"], key=lambda k: res["paths"][k]["tokens_per_s"]["distcourse"])
    rounds, paired = res["rounds"], res["paired"]
    first = [f"{best} (distcourse step)", "main job", "hf_trainer, fp32 eager"]
    assert rounds["best_path"] == best and rounds["order"] == [first, first[::-1]]
    rates = rounds["tokens_per_s"]
    assert res["main_job"]["tokens_per_s"] == statistics.median(rates["main job"])
    for k, other in (("main_job_vs_best_path", first[0]), ("defaults_vs_hf_trainer_defaults", first[2])):
        per = [x / y for x, y in zip(rates["main job"], rates[other])]
        assert paired[k] == {"ratio": statistics.median(per), "min": min(per), "max": max(per), "pairs": 2,
                             "per_pair": per} and res[k] == statistics.median(per), k
    matched = res["paths"]["bf16 compile"]  # the course's default path beside the Trainer, as measured there
    assert res["matched_vs_hf_trainer"] == matched["loop_vs_hf_trainer"]
    assert paired["matched_vs_hf_trainer"]["pairs"] == 4  # the bf16-compile path's steps, taking turns
    # time to the same validation loss: both curves reach the worse of the two finals, each in its seconds
    ttl = res["time_to_loss"]
    assert ttl["target_loss"] == max(ttl["distcourse"]["curve"][-1][2], ttl["hf_trainer"]["curve"][-1][2])
    for k in ("distcourse", "hf_trainer"):
        curve = ttl[k]["curve"]
        assert [s for _, s, _ in curve] == [0, 4, 8] and 0 < ttl[k]["seconds"] <= curve[-1][0], k
    ratio = ttl["hf_trainer"]["seconds"] / ttl["distcourse"]["seconds"]
    assert res["defaults_time_to_loss_vs_hf_trainer"] == ttl["ratio"] == ratio
    assert number(ttl["paired_estimate"])
    assert "Time to the same validation loss" in (tmp_path / "results.md").read_text()
    # smoke: the main job not compiled (CI seconds); --quick and full compile it, as auto does for 450 steps
    assert res["main_job"]["choices"]["compile"]["value"] is False
    assert isinstance(res["targets"]["main_job_vs_best_path"]["met"], bool)
    assert res["ddp"] is None and res["processes_vs_threads"] is None and res["loop_vs_hf_trainer"] is None
    assert res["weak_scaling"] is None and res["strong_scaling"] is None
    assert res["tp"] is None and "comm" not in res and "overlap" not in res
    assert res["targets"]["processes_vs_threads"]["met"] is None and set(res["tokens_per_s"]) == {"torch", "distcourse"}
    assert "| `processes_vs_threads` | — |" in (tmp_path / "results.md").read_text()


def test_rounds_alternate_and_the_ratio_is_the_median_of_the_pairs():
    "Two contenders on a machine that slows down as it goes (a fake clock): AB, BA, AB, BA; the median of a/b per pair."
    clock, calls = [0], []
    def contender(name, rate):
        def run():
            calls.append(name); clock[0] += 1
            return rate / (1 + 0.1 * clock[0])  # load that grows: whoever runs later looks slower
        return run
    rates, order = pairing.rounds({"a": contender("a", 2.0), "b": contender("b", 1.0)}, 4)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"] and order == [["a", "b"], ["b", "a"]] * 2
    r = pairing.paired(rates["a"], rates["b"])
    # per pair: 2·1.2/1.1, 2·1.3/1.4, 2·1.6/1.5, 2·1.7/1.8; the median is the mean of the middle two
    per = [2 * 1.2 / 1.1, 2 * 1.3 / 1.4, 2 * 1.6 / 1.5, 2 * 1.7 / 1.8]
    assert r["per_pair"] == pytest.approx(per) and r["pairs"] == 4
    assert r["ratio"] == pytest.approx((2 * 1.7 / 1.8 + 2 * 1.6 / 1.5) / 2)  # not their mean, not a ratio of medians
    assert (r["min"], r["max"]) == (pytest.approx(2 * 1.3 / 1.4), pytest.approx(2 * 1.2 / 1.1))
    assert abs(r["ratio"] - 2) < 0.02  # alternating, the drift cancels; always a first it would read ~2.13
    with pytest.raises(ValueError, match="one of each per round"): pairing.paired([1.0], [1.0, 2.0])


def test_time_to_a_loss_is_interpolated_between_evaluations():
    curve = [(0.0, 0, 9.0), (10.0, 4, 7.0), (20.0, 8, 5.0)]  # (training seconds, step, validation loss)
    assert pairing.crossing(curve, 6.0) == (15.0, 6.0) and pairing.crossing(curve, 7.0) == (10.0, 4.0)
    assert pairing.crossing(curve, 4.0) == (None, None)  # never reached


def test_bad_precision_says_what_to_pass(tmp_path):
    proc = run_cli([*RUN, "--precision", "fp16", "--out", str(tmp_path)], timeout=120)
    assert proc.returncode != 0 and "choose fp32 or bf16" in proc.stderr
    assert not (tmp_path / "results.json").exists()


# ------------------------------------------------------------------ tables rendered from results.json
def test_committed_tables_are_rendered_from_results_json():
    "docs/benchmarks.md's table, RESULTS.md's and results.md equal what the committed results.json renders to."
    proc = run_cli([PY, str(ROOT / "benchmarks" / "render.py"), "--check"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    readme = (ROOT / "docs/benchmarks.md").read_text()
    assert f"| `loop_vs_torch` (fp32, 8 × 128) | {RESULTS['loop_vs_torch']:.3f} |" in readme


def test_a_table_edited_by_hand_is_caught(tmp_path):
    "A number changed in one generated file, or in results.json, makes that file stale."
    for name in GENERATED:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    assert render.stale(RESULTS, tmp_path) == []
    readme = tmp_path / "docs/benchmarks.md"
    shown = f"| {RESULTS['processes_vs_threads']:.3f} |"
    readme.write_text(readme.read_text().replace(shown, "| 1.234 |"))
    assert render.stale(RESULTS, tmp_path) == [readme]
    shutil.copy(ROOT / "docs/benchmarks.md", readme)
    slower = RESULTS | {"loop_vs_torch": 0.5}  # a run that misses the target: "met" follows
    assert set(render.stale(slower, tmp_path)) == {tmp_path / name for name in GENERATED}
    assert "| `loop_vs_torch` (fp32, 8 × 128) | 0.500 | >= 0.97 | no |" in render.readme_section(slower)


def test_met_follows_the_stored_targets():
    "Each target is met at its threshold and missed just past it; unmeasured is neither."
    for metric, (comparison, threshold) in render.TARGETS.items():
        assert render.met(metric, threshold) is True, metric
        assert render.met(metric, threshold - 0.01) is False, metric
        if comparison == "==": assert render.met(metric, threshold + 0.01) is False, metric
        assert render.met(metric, None) is None, metric
    with pytest.raises(KeyError, match="add it to TARGETS"): render.met("tokens_per_s", 1.0)


def test_markers_missing_say_what_to_do():
    with pytest.raises(ValueError, match="results:begin"):
        render.replace_marked("a table without its markers", "x", "docs/benchmarks.md")


@pytest.mark.fast
def test_bucket_table_is_the_committed_run():
    """RESULTS.md's bucket table is what bench_buckets.py renders from buckets.json; its layouts are mesh layouts of
    layouts.json, in its order (layouts.json, re-measured 2026-11-30, has mesh layouts the trainer refused when the
    buckets were timed: they are not in the table)."""
    spec = importlib.util.spec_from_file_location("bench_buckets", ROOT / "benchmarks" / "bench_buckets.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    got = json.loads((ROOT / "benchmarks" / "buckets.json").read_text())
    assert bench.table(got) in (ROOT / "benchmarks" / "RESULTS.md").read_text()
    want = iter([(w, bench.name(lay)) for w, lay, _, _ in bench.mesh_layouts()])
    assert all(run in want for run in [(r["world"], r["layout"]) for r in got["runs"]])  # a subsequence
    for r in got["runs"]:  # paired: both variants timed as often, the ratio their medians'
        assert len(r["times"]["old"]) == len(r["times"]["new"]) == bench.K * bench.ROUNDS
        assert r["new_over_old"] == round(statistics.median(r["times"]["new"])
                                          / statistics.median(r["times"]["old"]), 3)


def test_tasks_bench_pairs_the_three_tasks(tmp_path):
    "benchmarks/bench_tasks.py: real trainer runs of clm, mlm and cls in alternating rounds, every field written."
    out = tmp_path / "tasks.json"
    r = run_cli([PY, str(ROOT / "benchmarks" / "bench_tasks.py"), "--rounds", "2", "--steps", "3", "--skip", "1",
                 "--seq_len", "16", "--batch_size", "2", "--out", str(out)], timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["order"] == [["clm", "mlm", "cls"], ["cls", "mlm", "clm"]]  # alternating
    assert all(len(res["rates"][t]) == 2 and min(res["rates"][t]) > 0 for t in ("clm", "mlm", "cls"))
    for name, t in (("mlm/clm", "mlm"), ("cls/clm", "cls")):
        want = statistics.median(a / b for a, b in zip(res["rates"][t], res["rates"]["clm"]))
        assert res["ratios"][name]["ratio"] == pytest.approx(want) and res["ratios"][name]["pairs"] == 2
    assert "mlm/clm:" in r.stdout
