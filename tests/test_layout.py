"""Lesson 05ja's layout object is the one place the trainer's composition rules live. Each row of `REFUSED` is removed
in turn and every caller must then accept the combination it refused: the configuration (09's `parse_args`, which the
CLI and `notebook_launcher` runs use) and the planner (09c). A module that restated a rule would keep refusing it, and
the test fails; `test_a_restated_rule_is_caught` restates one to watch that happen. Also: the configuration imports
nothing of the mesh or the training stack, and torch's DeviceMesh lays ranks out as lesson 05k's formula does."""
import ast
import re
import sys

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import GPT2Config

import distcourse.config as config
import distcourse.layout as layout
import distcourse.planner as plan
from conftest import ROOT
from distcourse.config import ConfigError, parse_args
from distcourse.layout import REFUSED, ParallelDims, build_mesh
from distcourse.machine import PROFILES
from distcourse.mesh import mesh_layout
from distcourse.sizes import shape_of

pytestmark = pytest.mark.fast  # parsing, planning and a fake process group: seconds

CASES = {  # a row of REFUSED -> (processes, flags) that use exactly that pair
    ("mesh", "task"): (2, ["--tp", "2", "--task", "mlm"]),
    ("mesh", "model"): (2, ["--tp", "2", "--model", "{gpt2}"]),
    ("cp", "dropout"): (2, ["--cp", "2", "--model", "base"]),
    ("pp", "dropout"): (2, ["--pp", "2", "--grad_accum", "2", "--model", "base"]),
    ("experts", "cp"): (2, ["--model", "tiny-moe", "--cp", "2"]),
    ("experts", "pp"): (2, ["--model", "tiny-moe", "--pp", "2", "--grad_accum", "2"]),
    ("experts", "zero_stage"): (2, ["--model", "tiny-moe", "--zero_stage", "1"]),
    ("experts", "task"): (1, ["--model", "tiny-moe", "--task", "mlm"]),
    ("mesh", "compile"): (2, ["--tp", "2", "--compile", "true"]),
    ("experts", "compile"): (1, ["--model", "tiny-moe", "--compile", "true"]),
    ("zero3", "zero_bubble"): (4, ["--model", "tiny", "--n_layer", "4", "--pp", "2", "--pp_schedule", "zbv",
                                   "--grad_accum", "4", "--zero_stage", "3"]),
}


def test_every_row_has_a_case():
    assert set(CASES) == set(REFUSED)


def argv_of(row, tmp_path) -> list:
    "The case's flags, a local GPT-2 directory where a non-preset model is needed."
    gpt2 = tmp_path / "gpt2"
    if not gpt2.exists(): GPT2Config(n_layer=2, n_head=2, n_embd=64).save_pretrained(gpt2)
    flags = [f.format(gpt2=gpt2) for f in CASES[row][1]]
    return [*flags, "--output_dir", str(tmp_path / "out")]


def accepted_without(row, monkeypatch, tmp_path) -> bool:
    "Refused with its row's reason while the row is there; then True if parsing accepts it without the row."
    monkeypatch.setenv("WORLD_SIZE", str(CASES[row][0]))
    with pytest.raises(ConfigError, match=re.escape(REFUSED[row])):
        parse_args(argv_of(row, tmp_path))
    with monkeypatch.context() as m:
        m.delitem(layout.REFUSED, row)
        try: parse_args(argv_of(row, tmp_path))
        except ConfigError: return False
    return True


@pytest.mark.parametrize("row", CASES, ids=lambda r: "-".join(r))
def test_a_row_removed_unlocks_it_in_the_configuration(row, monkeypatch, tmp_path):
    assert accepted_without(row, monkeypatch, tmp_path), f"{row}: still refused without its row, so restated"


def test_a_restated_rule_is_caught(monkeypatch, tmp_path):
    "The guard can fail: a configuration that also refuses experts with pp on its own keeps the pair refused."
    def restating(d, *args, **kw):
        layout.check(d, *args, **kw)
        model = (args[3:4] or [kw.get("model")])[0]  # check(d, sizes, seq_len, grad_accum, model, ...)
        if d.pp > 1 and model == "tiny-moe": raise ValueError("experts with --pp: refused here too")
        return d
    monkeypatch.setattr(config, "check", restating)
    assert not accepted_without(("experts", "pp"), monkeypatch, tmp_path)
    assert accepted_without(("experts", "cp"), monkeypatch, tmp_path)  # the rows it does not restate: unlocked


PLANNED = {  # a row -> (model, a property of a layout that only the row keeps out of the planner's list)
    ("experts", "pp"): ("tiny-moe", lambda L: L.pp > 1),
    ("experts", "cp"): ("tiny-moe", lambda L: L.cp > 1),
}


@pytest.mark.parametrize("row", PLANNED, ids=lambda r: "-".join(r))
def test_a_row_removed_unlocks_it_in_the_planner(row, monkeypatch):
    model, has = PLANNED[row]
    shape, profile = shape_of(model, 4 if model == "small" else 0), PROFILES["h100-node"]
    def listed(): return [L for L in plan.layouts(shape, 4, 16, 128, profile, model=model, n_layer=shape.n_layer
                                                  if model == "small" else 0) if has(L)]
    assert not listed(), row
    monkeypatch.delitem(layout.REFUSED, row)
    assert listed(), f"{row}: the planner still leaves it out without its row, so it restates the rule"


def imports_of(module) -> set:
    "The package modules `module` imports at its top level."
    tree = ast.parse((ROOT / "distcourse" / f"{module}.py").read_text())
    return {n.module.split(".")[-1] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module
            and (n.level == 1 or n.module.startswith("distcourse."))}


def test_config_imports_neither_the_mesh_nor_the_training_stack():
    seen, todo = set(), ["config"]
    while todo:
        m = todo.pop()
        if m not in seen: seen.add(m); todo += imports_of(m)
    stack = {"mesh", "expert_mesh", "engines", "ddp", "zero", "launch", "train", "evaluation", "resume", "reshard",
             "outputs", "plan", "planner"}
    assert "layout" in seen and not seen & stack, sorted(seen & stack)


def test_imports_of_reads_the_package():
    assert {"layout", "experts", "model"} <= imports_of("config") and "mesh" in imports_of("expert_mesh")


def device_mesh_groups(d, rank) -> dict:
    "Each axis's ranks in the group of `rank`, from the DeviceMesh that rank builds (torch's fake process group)."
    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=d.world)
    try:
        mesh = build_mesh(d)
        return {k: dist.get_process_group_ranks(mesh.get_group(k)) for k in mesh.mesh_dim_names}
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


@pytest.mark.parametrize("d", [ParallelDims(16, tp=2, cp=2, pp=2), ParallelDims(8, tp=4), ParallelDims(8, pp=2)],
                         ids=str)
def test_device_mesh_is_the_formula(d):
    lay = mesh_layout(d.world, d.tp, d.pp, d.cp)
    for r in range(d.world):
        assert device_mesh_groups(d, r) == {k: next(g for g in lay[k] if r in g) for k in ("pp", "dp", "cp", "tp")}


def test_device_mesh_with_experts():
    "ep splits the data axis: an ep group is ep consecutive dp ranks (05j's ep_groups), copies ep apart."
    got = device_mesh_groups(ParallelDims(8, ep=2), 5)
    assert (got["ep"], got["dp_mod_ep"]) == ([4, 5], [1, 3, 5, 7])
