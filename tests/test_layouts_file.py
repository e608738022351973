"""The committed benchmarks/layouts.json (written by benchmarks/layouts.py, which launches and is not run here) has
the fields the planner reads: every layout tried, each refused one with the trainer's line, each accepted one with
its seconds per step and a peak per rank (or why its schedule does not measure one), or the error a launch stopped
with. No speed is asserted."""
import json
import math

import pytest

from conftest import ROOT

pytestmark = pytest.mark.fast  # every test here is quick: in the fast tier

DATA = json.loads((ROOT / "benchmarks" / "layouts.json").read_text())
LAYOUT = {"dp", "tp", "pp", "cp", "cp_impl", "zero_stage", "pp_schedule", "grad_accum", "batch_size",
          "activation_checkpointing"}


def test_header():
    assert {"command", "date", "machine", "model", "seq_len", "global_batch", "steps", "runs"} <= DATA.keys()
    assert {"cpu", "cores", "torch"} <= DATA["machine"].keys()
    assert {"preset", "n_layer", "n_embd", "n_head", "vocab_size", "n_params"} <= DATA["model"].keys()


def test_runs():
    worlds = {r["world"] for r in DATA["runs"]}
    assert {2, 4} <= worlds, worlds
    for r in DATA["runs"]:
        lay, where = r["layout"], (r["world"], r["layout"])
        assert lay.keys() == LAYOUT, where
        assert lay["dp"] * lay["tp"] * lay["pp"] * lay["cp"] == r["world"], where
        assert lay["dp"] * lay["grad_accum"] * lay["batch_size"] == DATA["global_batch"], where  # one global batch
        flags = dict(zip(r["flags"][::2], r["flags"][1::2]))
        assert all(flags[f"--{k}"] == str(lay[k]) for k in ("tp", "pp", "cp", "zero_stage", "batch_size")), where
        if r["refused"]:
            assert r["refused"].startswith("distcourse.train: error: --"), where  # the trainer's own line
            continue
        if r.get("not_run") and r["world"] != 4: continue  # the measurement window ended (world 4 runs first)
        if r.get("error"):  # accepted, launched, and stopped: recorded with what it stopped with, never timed
            assert r["step_s"] is None and r["error"].split(":")[0] in ("ChildFailedError", "SignalException"), where
            continue
        assert r["parallel"]["dp"] == lay["dp"] and r["parallel"]["cp_impl"] == lay["cp_impl"], where
        assert r["step_s"] > 0 and math.isfinite(r["step_s"]), where
        assert len(r["step_s_all"]) >= DATA["steps"] - DATA["warmup_steps_left_out"], where
        if r["peak_bytes"] is None: assert r["peak_why"].startswith("not measured"), where
        else: assert len(r["peak_bytes"]) == r["world"] and min(r["peak_bytes"]) > 0, where
