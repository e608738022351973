"""Muon in the trainer (lesson 05aa): DDP and ZeRO-2/3 accepted; ZeRO-1 and the mesh refused before any work, with
the flags to change; Accelerate's DeepSpeed and FSDP plugins are refused once the launcher is known; the optimizer
keeps its parameter split, learning rates and state through a save and load; ShardedMuon's owners, traffic and
state on 2 and 4 real processes. (That `--optimizer muon` on 2 and 4 processes equals one process at every step,
and a resume repeats its steps, is proved in tests/test_mutation.py: checks `dp2 muon`, `zero2 muon`, `zero3 muon
4`, `muon resume` and `zero3 muon resume`, with six planted faults.)"""
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from conftest import ROOT
from distcourse.config import ConfigError, parse_args
from distcourse.model import build_model
from distcourse.muon import MuonAdamW, check_muon, make_schedule, muon_params

pytestmark = pytest.mark.fast

TINY = ["--config", str(ROOT / "configs/tiny.yaml"), "--optimizer", "muon"]


@pytest.mark.parametrize("flags, world, names", [
    (["--zero_stage", "1"], 2, "--zero_stage 1"), (["--zero_stage", "2", "--tp", "2"], 4, "--tp 2"),
    (["--tp", "2"], 2, "--tp 2"), (["--pp", "2", "--grad_accum", "2"], 2, "--pp 2"),
    (["--model", "tiny-moe"], 1, "--model tiny-moe")])
def test_muon_refuses_sliced_layouts(flags, world, names, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    want = f"--optimizer muon with .*{names}.*--zero_stage 0, 2 or 3, or --optimizer adamw"
    with pytest.raises(ConfigError, match=want):
        parse_args([*TINY, *flags, "--output_dir", str(tmp_path / "run")])
    cfg = parse_args([*TINY[:2], *flags, "--output_dir", str(tmp_path / "run")])  # AdamW: the same layout runs
    assert cfg.optimizer == "adamw"


@pytest.mark.parametrize("stage", ["0", "2", "3"])
def test_muon_runs_under_ddp_and_fsdp(stage, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = parse_args([*TINY, "--schedule", "wsd", "--zero_stage", stage, "--output_dir", str(tmp_path / "run")])
    assert (cfg.optimizer, cfg.schedule, cfg.zero_stage) == ("muon", "wsd", int(stage))


@pytest.mark.parametrize("kind", [DistributedType.DEEPSPEED, DistributedType.FSDP])
def test_muon_refuses_the_sharding_plugins(kind):
    acc = SimpleNamespace(distributed_type=kind)
    with pytest.raises(ValueError, match=f"optimizer muon under Accelerate's {kind.value} plugin.*--optimizer adamw"):
        check_muon(acc, "muon")
    check_muon(acc, "adamw")  # AdamW runs there
    check_muon(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU), "muon")  # DDP: Muon runs


def test_split_state_and_schedule_survive_a_reload():
    torch.manual_seed(0)
    model = build_model("tiny", "clm", vocab_size=64)
    hidden, rest = muon_params(model)
    assert all(p.dim() == 2 for p in hidden) and {p.dim() for p in rest} == {1, 2}
    assert not any(p is model.transformer.wte.weight for p in hidden)  # the tied embedding: AdamW's
    opt = MuonAdamW(model, 1e-2)
    sched = make_schedule(opt, 2, 10, "cosine")
    for _ in range(3):
        model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss.backward()
        opt.step(); sched.step(); opt.zero_grad()
    again = MuonAdamW(model, 1e-2)
    sched2 = make_schedule(again, 2, 10, "cosine")
    again.load_state_dict(opt.state_dict()); sched2.load_state_dict(sched.state_dict())
    sched2.step()  # the next rate must reach both inner optimizers' groups
    sched.step()
    for inner in ("muon", "adamw"):
        rates = [[g["lr"] for g in getattr(o, inner).param_groups] for o in (again, opt)]
        assert rates[0] == rates[1], (inner, rates)
    assert len(again.state) == len(opt.state) == len(hidden) + len(rest)
