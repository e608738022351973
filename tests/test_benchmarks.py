"""`benchmarks/run.py` runs end to end in its smallest form and writes every field; its speeds are not tested
(performance is reported as ratios in benchmarks/RESULTS.md, never asserted by a test). The README's benchmark
table, RESULTS.md's and results.md are what the committed results.json renders to (`benchmarks/render.py`)."""
import importlib.util
import json
import math
import shutil

import pytest

from conftest import PY, ROOT, run_cli
from distcourse.comm import TIMED

_spec = importlib.util.spec_from_file_location("render", ROOT / "benchmarks" / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)
RESULTS = json.loads((ROOT / "benchmarks" / "results.json").read_text())
GENERATED = ("README.md", "benchmarks/RESULTS.md", "benchmarks/results.md")

RUN = [PY, str(ROOT / "benchmarks" / "run.py"), "--smoke"]
CONTENDERS = {"torch", "distcourse", "hf_trainer"}


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
    for k in ("loop_vs_torch", "loop_vs_hf_trainer", "ddp2_efficiency", "data_tokens_per_s", "mm_utilisation",
              "peak_flops"):
        assert number(res[k]) and res[k] > 0, k
    assert res["mm_utilisation"] == res["mm_utilisation_by_contender"]["distcourse"]
    assert res["peak"]["flops_per_s"] == res["peak_flops"]
    assert res["mfu"] is None and res["peak"]["card"] is None  # a CPU: no datasheet peak, so no MFU
    assert set(res["tokens_per_s"]) == CONTENDERS and all(number(v) and v > 0 for v in res["tokens_per_s"].values())
    assert set(res["step_s"]) == CONTENDERS | {"matmul"}
    assert all(len(v) == res["config"]["steps"] for v in res["step_s"].values())  # warm-up steps left out
    assert set(res["ratios"]) == {"loop_vs_torch", "loop_vs_hf_trainer", "hf_trainer_vs_torch"}
    assert isinstance(res["device"], str) and res["device"].startswith(("cpu", "cuda"))
    assert {"torch", "transformers", "accelerate", "datasets", "distcourse"} <= set(res["versions"])
    assert res["threads"]["torch"] >= 1 and res["config"]["model"] == "tiny"
    rows = res["comm"]["2"]  # the collectives lesson's measurement, 2 gloo processes
    assert {r["collective"] for r in rows} == set(TIMED) and all(r["seconds"] > 0 and r["busbw"] > 0 for r in rows)


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
    assert res["data_tokens_per_s"] == res["data"]["data_tokens_per_s"] and res["data"]["packed_tokens"] > 0


def test_two_processes_were_one_gloo_group(smoke):
    ddp = smoke[0]["ddp"]
    assert ddp["distributed_type"] == {"1": "NO", "2": "MULTI_CPU"}  # not two lone copies
    assert ddp["ddp2_efficiency"] == smoke[0]["ddp2_efficiency"] and len(ddp["step_s"]["2"]) == ddp["bench"]["steps"]
    assert number(ddp["allreduce_s"]) and ddp["allreduce_s"] > 0
    # lesson 03a's prediction of that all-reduce from the bus-bandwidth table, beside it; the table drawn
    assert ddp["allreduce_bytes"] > 0 and ddp["allreduce_bytes"] % 4 == 0  # every fp32 gradient
    assert number(ddp["allreduce_predicted_s"]) and ddp["allreduce_predicted_s"] > 0
    assert "predicted from this table" in smoke[1] and (smoke[2] / "comm.png").stat().st_size > 0


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
    proc = run_cli([*RUN, "--no_ddp", "--no_hf", "--no_comm", "--no_tp", "--paths", "--out", str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["paths"]) == {"fp32 eager", "fp32 compile", "bf16 eager", "bf16 compile"}
    for name, v in res["paths"].items():  # the Trainer too on its default path (fp32 eager) and the course's
        with_hf = name in ("fp32 eager", "bf16 compile")
        assert number(v["loop_vs_torch"]), name
        assert set(v["tokens_per_s"]) == {"torch", "distcourse"} | ({"hf_trainer"} if with_hf else set()), name
    best = max(v["tokens_per_s"]["distcourse"] for v in res["paths"].values())
    assert res["main_job_vs_best_path"] == res["main_job"]["tokens_per_s"] / best
    assert number(res["defaults_vs_hf_trainer_defaults"]) and number(res["matched_vs_hf_trainer"])
    assert res["main_job"]["choices"]["compile"]["value"] is True and isinstance(res["targets"]["main_job_vs_best_path"]["met"], bool)
    assert res["ddp"] is None and res["ddp2_efficiency"] is None and res["loop_vs_hf_trainer"] is None
    assert res["tp"] is None and "comm" not in res
    assert res["targets"]["ddp2_efficiency"]["met"] is None and set(res["tokens_per_s"]) == {"torch", "distcourse"}
    assert "| `ddp2_efficiency` | — |" in (tmp_path / "results.md").read_text()


def test_bad_precision_says_what_to_pass(tmp_path):
    proc = run_cli([*RUN, "--precision", "fp16", "--out", str(tmp_path)], timeout=120)
    assert proc.returncode != 0 and "choose fp32 or bf16" in proc.stderr
    assert not (tmp_path / "results.json").exists()


# ------------------------------------------------------------------ tables rendered from results.json
def test_committed_tables_are_rendered_from_results_json():
    "README.md's table, RESULTS.md's and results.md equal what the committed results.json renders to."
    proc = run_cli([PY, str(ROOT / "benchmarks" / "render.py"), "--check"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    readme = (ROOT / "README.md").read_text()
    assert f"| `loop_vs_torch` (fp32, 8 × 128) | {RESULTS['loop_vs_torch']:.3f} |" in readme


def test_a_table_edited_by_hand_is_caught(tmp_path):
    "A number changed in one generated file, or in results.json, makes that file stale."
    for name in GENERATED:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    assert render.stale(RESULTS, tmp_path) == []
    readme = tmp_path / "README.md"
    shown = f"| {RESULTS['ddp2_efficiency']:.3f} |"
    readme.write_text(readme.read_text().replace(shown, "| 1.234 |"))
    assert render.stale(RESULTS, tmp_path) == [readme]
    shutil.copy(ROOT / "README.md", readme)
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
        render.replace_marked("a table without its markers", "x", "README.md")
