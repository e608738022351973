"""Muon in the trainer (lesson 05aa): DDP and ZeRO-2/3 accepted; ZeRO-1 and the mesh refused before any work, with
the flags to change; Accelerate's DeepSpeed and FSDP plugins are refused once the launcher is known; the optimizer
keeps its parameter split, learning rates and each parameter's state through a save and load (and loads the
earlier two-part form); `ShardedMuon` on 3 real processes, where FSDP2's shards are uneven, one rank holds no row
of a matrix and a round is short, equals torch.optim.Muon on the whole matrices to the bit and sends what
`muon_sent_bytes` predicts. (That `--optimizer muon` on 2 and 4 processes equals one process at every step, and a
resume repeats its steps, is proved in tests/test_mutation.py: checks `dp2 muon`, `zero2 muon`, `zero3 muon 4`,
`muon resume` and `zero3 muon resume`, with seven planted faults.)"""
import json
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from conftest import ROOT
from distcourse.config import ConfigError, parse_args
from distcourse.launch import launch
from distcourse.model import build_model
from distcourse.muon import MuonAdamW, check_muon, make_schedule, muon_params

fast = pytest.mark.fast

TINY = ["--config", str(ROOT / "configs/tiny.yaml"), "--optimizer", "muon"]


@fast
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


@fast
@pytest.mark.parametrize("stage", ["0", "2", "3"])
def test_muon_runs_under_ddp_and_fsdp(stage, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = parse_args([*TINY, "--schedule", "wsd", "--zero_stage", stage, "--output_dir", str(tmp_path / "run")])
    assert (cfg.optimizer, cfg.schedule, cfg.zero_stage) == ("muon", "wsd", int(stage))


@fast
@pytest.mark.parametrize("kind", [DistributedType.DEEPSPEED, DistributedType.FSDP])
def test_muon_refuses_the_sharding_plugins(kind):
    acc = SimpleNamespace(distributed_type=kind)
    with pytest.raises(ValueError, match=f"optimizer muon under Accelerate's {kind.value} plugin.*--optimizer adamw"):
        check_muon(acc, "muon")
    check_muon(acc, "adamw")  # AdamW runs there
    check_muon(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU), "muon")  # DDP: Muon runs


@fast
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
    for inner in ("muon", "adamw"):  # each parameter's own state, in the optimizer that steps it
        mine, theirs = getattr(again, inner), getattr(opt, inner)
        for p in (hidden if inner == "muon" else rest):
            assert theirs.state[p] and all(torch.equal(v, mine.state[p][k]) for k, v in theirs.state[p].items())


@fast
def test_a_checkpoint_in_the_earlier_two_part_form_loads():
    torch.manual_seed(0)
    model = build_model("tiny", "clm", vocab_size=64)
    opt = MuonAdamW(model, 1e-2)
    model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss.backward()
    opt.step()
    again = MuonAdamW(model, 1e-2)
    again.load_state_dict({"muon": opt.muon.state_dict(), "adamw": opt.adamw.state_dict()})  # as saved before
    for inner in ("muon", "adamw"):
        for p, st in getattr(opt, inner).state.items():
            assert all(torch.equal(v, getattr(again, inner).state[p][k]) for k, v in st.items())


SHAPES = [(5, 7), (2, 9), (64, 16), (7, 3), (9, 4)]  # on 3 ranks: rows 2,2,1 / 1,1,0 / ... and a short round


def _uneven_worker(out):
    "ShardedMuon on FSDP2's uneven row shards against torch.optim.Muon on the whole matrices, 2 steps."
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from distcourse.launch import make_accelerator
    from distcourse.muon import ShardedMuon, muon_sent_bytes
    acc, kw = make_accelerator(), dict(lr=0.05, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    torch.manual_seed(0)
    whole = [torch.nn.Parameter(torch.randn(*s)) for s in SHAPES]
    sharded = torch.nn.ParameterList([torch.nn.Parameter(p.detach().clone()) for p in whole])
    fully_shard(sharded, mesh=init_device_mesh("cpu", (acc.num_processes,)))
    opt, ref = ShardedMuon(list(sharded.parameters()), **kw), torch.optim.Muon(whole, **kw)
    for _ in range(2):
        grads = [torch.randn(*s) for s in SHAPES]  # the same on every rank (one seed)
        for p, q, g in zip(sharded.parameters(), whole, grads):
            p.grad, q.grad = distribute_tensor(g, p.device_mesh, p.placements), g.clone()
        opt.step(); ref.step()
    equal = all(torch.equal(p.full_tensor(), q.detach()) for p, q in zip(sharded.parameters(), whole))
    sent = muon_sent_bytes(SHAPES, acc.num_processes)[acc.process_index] * 2  # two steps
    if acc.is_main_process or not equal or opt.sent_bytes != sent:
        (out / f"rank{acc.process_index}.json").write_text(json.dumps({"equal": equal, "sent": [opt.sent_bytes, sent]}))


@pytest.mark.parametrize("world", [3])
def test_sharded_muon_on_uneven_shards_equals_torchs(world, tmp_path):
    launch(_uneven_worker, (tmp_path,), num_processes=world, timeout=180)
    for f in tmp_path.glob("rank*.json"):
        r = json.loads(f.read_text())
        assert r["equal"] and r["sent"][0] == r["sent"][1], (f.name, r)
    assert (tmp_path / "rank0.json").exists()
