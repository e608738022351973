"""The trainer's --tp, --cp and --pp: the losses and gradients of one process on the same global
batch, model/ whole, exact resume, bad inputs."""
import copy
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import ACCELERATE, ROOT, free_port, grads_diff, run_cli, trainer_cmd, worst_rel
from distcourse.config import ConfigError, parse_args
from distcourse.launch import launch
from distcourse.loop import count_targets, loss_sum, make_optimizer, make_scheduler
from distcourse.mesh import Mesh, mesh_layout
from distcourse.train import main

# 10 steps of the tiny model; every run has the same global batch, batch_size × grad_accum × dp =
# 4 × 4 × 1, and writes step 1's full gradients (GPT-2 names, gathered over tp, pp): grads_step1.pt
ARGS = ["--config", str(ROOT / "configs/tiny.yaml"), "--max_steps", "10", "--log_every", "1", "--eval_every", "0",
        "--seq_len", "32", "--batch_size", "4", "--grad_accum", "4", "--max_examples", "300",
        "--tracker", "none", "--grads_at", "1"]
# AdamW and clipping hide a constant factor on all gradients (x 4 moved 20 steps' losses by 8.5e-8):
# the pre-clip gradient norm of every step (relative) and step 1's full gradients (each tensor's ‖Δg‖ over
# its own norm, conftest's grads_diff) are compared with one process. Measured on every layout over 20 steps,
# before gradients were compared per tensor: norms ≤ 1.4e-7, step 1's gradients ≤ 7.2e-8 of the whole norm.
NORM_TOL = GRAD_TOL = 1e-5
# tp 2 and dp 2 × pp 2 alone are proved on gradients in tests/test_paths.py (3 steps); the layouts here add what
# 10 steps show: resume, model/ whole, the tied copies in a checkpoint's pieces, MFU and memory records.
MESHES = {"dp2_tp2": (4, ["--tp", "2", "--batch_size", "2"]),  # 4 processes: 2 replicas of a tp pair, 2 × 4 × 2
          "cp2": (2, ["--cp", "2"]), "pp2": (2, ["--pp", "2", "--pp_schedule", "1f1b"]),
          "tp2_cp2": (4, ["--tp", "2", "--cp", "2"]),  # one replica: 2 cp ranks of a tp pair each, 4 × 4 × 1
          "tp2_pp2": (4, ["--tp", "2", "--pp", "2"]),  # one pipeline of 2 stages, each a tp pair: 4 × 4 × 1
          "pp2_cp2": (4, ["--pp", "2", "--cp", "2", "--cp_impl", "ulysses"])}  # 2 stages, each a Ulysses cp pair
# (the 8-process layouts, tp 2 × pp 2 × cp 2 and dp 2 × pp 2 × cp 2, are proved on the step itself below: cheaper)
# Resumed from their checkpoints at their own layout, exactly: every checkpoint holds one process's tensors whole
# (tp pairs gathered, each stage its own names, dp and cp copies written once), and each layout cuts them back into
# its pieces: tp's slices (dp2_tp2; tp 2 resumes it below), cp's whole model (cp2), stages (pp2_cp2, with Ulysses),
# stages of tp slices (tp2_pp2). tests/test_paths.py resumes checkpoints at other layouts.
RESUMED = ["dp2_tp2", "cp2", "pp2_cp2", "tp2_pp2"]
# Every pp layout also keeps its step-10 checkpoint: the first stage writes wte, the last lm_head.
SAVED = {*RESUMED, *(name for name in MESHES if "pp" in name)}
WTE, HEAD = "transformer.wte.weight", "lm_head.weight"  # the tied matrix's two names


def train_losses(out, key="loss"):
    return [r[key] for r in map(json.loads, open(out / "metrics.jsonl")) if "split" not in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process, and the same global batch on every mesh (each with a timeout: a hang fails; ranks forked: see
    conftest); the RESUMED layouts save checkpoints at steps 5 and 10, the other pp layouts at step 10."""
    tmp = tmp_path_factory.mktemp("mesh")
    def run(name, world, flags):  # two runs at a time: much of a run is imports and process starts, one core each
        saves = [] if world == 1 else ["--save_every", "5" if name in RESUMED else "10" if name in SAVED else "0"]
        return run_cli([*trainer_cmd(world), *ARGS, *flags, *saves, "--output_dir", str(tmp / name)], timeout=300)
    with ThreadPoolExecutor(2) as pool:
        procs = {name: pool.submit(run, name, *layout) for name, layout in {"one": (1, []), **MESHES}.items()}
        for name, proc in procs.items(): assert proc.result().returncode == 0, (name, proc.result().stderr[-3000:])
    return tmp


@pytest.mark.parametrize("name", list(MESHES))
def test_mesh_losses_equal_one_process(runs, name):
    want, got = train_losses(runs / "one"), train_losses(runs / name)
    assert len(want) == len(got) == 10
    worst = max(abs(a - b) / abs(a) for a, b in zip(want, got))
    assert worst <= 1e-4, (name, worst)
    run = json.loads((runs / name / "run.json").read_text())
    degrees = {"dp": 1, **{k: int(v) for k, v in re.findall(r"(dp|tp|cp|pp)(\d)", name)}}  # tp2_cp2: 2, 2
    assert run["world_size"] == MESHES[name][0] and {k: run["parallel"][k] for k in degrees} == degrees
    one = json.loads((runs / "one/run.json").read_text())
    assert abs(run["final"]["loss"] - one["final"]["loss"]) <= 1e-4 * one["final"]["loss"]  # same validation
    assert run["final"]["samples"] == one["final"]["samples"]
    assert run["parallel"]["cp_impl"] == (None if "cp" not in degrees else "ulysses" if "--cp_impl" in MESHES[name][1]
                                          else "ring")  # cp's attention, in run.json
    if name == "pp2":  # the bubble is a timing: recorded, not bounded (the machine is shared)
        assert run["parallel"]["pp_schedule"] == "1f1b" and isinstance(run["parallel"]["bubble"], float)
    print(f"{name}: largest relative loss difference {worst:.1e} over 10 steps")


@pytest.mark.parametrize("name", list(MESHES))
def test_mesh_gradients_equal_one_process(runs, name):
    "The pre-clip gradient norm of every step, and every parameter's full gradient at step 1."
    one, mesh = runs / "one", runs / name
    norms = worst_rel(train_losses(one, "grad_norm"), train_losses(mesh, "grad_norm"))
    grads = grads_diff(one / "grads_step1.pt", mesh / "grads_step1.pt")  # same keys and shapes
    print(f"{name}: worst relative gradient norm {norms:.1e} over 10 steps, step 1's gradients "
          f"{grads:.1e}")
    assert norms <= NORM_TOL and grads <= GRAD_TOL, (name, norms, grads)


@pytest.mark.parametrize("name", list(MESHES))
def test_mesh_records_mfu_memory(runs, name):
    "Every record of a mesh run: model FLOPs over all ranks' peak (a measured matmul rate on CPU), every rank's memory."
    recs = [r for r in map(json.loads, open(runs / name / "metrics.jsonl")) if "split" not in r]
    assert all(0 < r["mm_utilisation"] <= 1 and "mfu" not in r and r["rss_mb_max"] >= r["rss_mb_min"] > 0
               and r["tokens_per_s"] > 0 for r in recs), recs[0]
    run = json.loads((runs / name / "run.json").read_text())
    u, one = run["utilisation"], json.loads((runs / "one/run.json").read_text())["utilisation"]
    assert u["flops_per_token"] == one["flops_per_token"]  # the whole model's, as one process counts it
    assert u["tokens_processed"] == one["tokens_processed"]  # the global batch's tokens, counted once, not per rank
    assert 0 < u["mm_utilisation_median"] <= 1 and u["peak_per_rank"]["used"] == "measured"
    assert run["memory"]["activation_bytes"] > 0
    assert len(run["memory"]["per_rank"]) == run["world_size"]
    for r in run["memory"]["per_rank"]:  # each rank's piece: its first step measured, above what it counted saved
        assert r["peak_first_step"]["cpu"]["ACT"] > r["activation_bytes"] > 0, r
    assert run["memory"]["rss_mb_max_all_ranks"] >= run["memory"]["rss_mb_min_all_ranks"] > 0
    print(f"{name}: mm_utilisation median {u['mm_utilisation_median']:.2%}, "
          f"activation bytes {run['memory']['activation_bytes']}")


def test_tp_saves_less_for_backward(runs):
    "tp 2 keeps a tp rank's share of each block's activations: fewer bytes than the same mesh without tp."
    saved = {n: json.loads((runs / n / "run.json").read_text())["memory"]["activation_bytes"]
             for n in ("cp2", "tp2_cp2", "pp2", "tp2_pp2")}  # the course's GPT on both sides of each pair
    print(saved)
    assert saved["tp2_cp2"] < saved["cp2"] and saved["tp2_pp2"] < saved["pp2"]


def saved_tensors(ckpt) -> dict:
    "{key: tensor} of a checkpoint's dcp pieces (custom_0.model.<name>, custom_0.optimizer.state.<name>.<moment>)."
    meta = dcp.FileSystemReader(str(ckpt / "sharded")).read_metadata().state_dict_metadata
    keys = [k for k in meta if hasattr(meta[k], "size")]  # the tensors, not the pickled values
    got = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in keys}
    dcp.load(got, checkpoint_id=ckpt / "sharded", no_dist=True)  # one reader, no process group
    return got


@pytest.mark.parametrize("name", list(MESHES))
def test_model_saved_whole(runs, name):
    """model/ of a mesh run loads with from_pretrained and holds the weights one process trained; its step-10
    checkpoint holds one process's names and shapes, each equal to the bit to model/'s (the tied matrix's two names
    too: pp saves wte from the first stage, lm_head from the last)."""
    want = AutoModelForCausalLM.from_pretrained(runs / "one/model").state_dict()
    got = AutoModelForCausalLM.from_pretrained(runs / name / "model").state_dict()
    assert got.keys() == want.keys()
    # All weights as one vector: a key bias (in c_attn.bias) gets a zero gradient in exact arithmetic (softmax
    # ignores a shift of every score), so AdamW turns float noise there into lr-sized steps, in either run.
    diff = sum((got[k] - w).pow(2).sum() for k, w in want.items()).sqrt()
    assert diff / sum(w.pow(2).sum() for w in want.values()).sqrt() <= 1e-4
    if name not in SAVED: return
    saved = saved_tensors(runs / name / "checkpoints/step_10")
    model = {k.removeprefix("custom_0.model."): t for k, t in saved.items() if k.startswith("custom_0.model.")}
    assert model.keys() == want.keys(), sorted(model.keys() ^ want.keys())
    for k, t in model.items(): assert torch.equal(t, got[k]), (k, (t - got[k]).abs().max())
    assert torch.equal(model[HEAD], model[WTE])


@pytest.mark.parametrize("name", RESUMED)
def test_mesh_resume_is_exact(runs, name, tmp_path, monkeypatch):
    "A copy of the run without its step-10 checkpoint, resumed: steps 6-10 repeat the straight run's losses exactly."
    world, flags = MESHES[name]
    again = tmp_path / name
    shutil.copytree(runs / name, again)
    shutil.rmtree(again / "checkpoints/step_10")
    meta = dcp.FileSystemReader(str(again / "checkpoints/step_5/sharded")).read_metadata().state_dict_metadata
    moments = {k.split(".state.")[1].rsplit(".", 1)[0] for k in meta if ".optimizer.state." in k}
    one = AutoModelForCausalLM.from_pretrained(runs / "one/model")
    assert moments == {n for n, _ in one.named_parameters()}  # one process's AdamW: the tied matrix once, as wte
    for n, p in one.named_parameters():  # whole, in transformers' shapes, whatever piece each rank held
        assert tuple(meta[f"custom_0.optimizer.state.{n}.exp_avg"].size) == tuple(p.shape), n
    monkeypatch.setenv("WORLD_SIZE", str(world))  # ZeRO-1 reads no dcp pieces: refused before a process starts
    with pytest.raises(ConfigError, match="ZeRO-1 without them reads Accelerate's whole files only"):
        parse_args([*ARGS, "--save_every", "5", "--resume", "latest", "--zero_stage", "1",
                    "--output_dir", str(again)])
    proc = run_cli([*trainer_cmd(world), *ARGS, *flags, "--save_every", "5", "--resume", "latest",
                    "--output_dir", str(again)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert train_losses(again) == train_losses(runs / name)  # bit for bit: the same layout, the same arithmetic
    assert train_losses(again, "grad_norm") == train_losses(runs / name, "grad_norm")  # exact too
    run = json.loads((again / "run.json").read_text())
    straight = json.loads((runs / name / "run.json").read_text())["parallel"]
    assert run["resumed_from"]["step"] == 5
    assert {k: v for k, v in run["parallel"].items() if k != "bubble"} == {k: v for k, v in straight.items() if k != "bubble"}



def test_mesh_resumes_on_another_dp(runs, tmp_path):
    "dp 2 × tp 2's step-5 checkpoint resumed by dp 1 × tp 2 under `accelerate launch` (twice the batch_size: the same global batch)."
    again = tmp_path / "tp2"
    shutil.copytree(runs / "dp2_tp2", again)
    shutil.rmtree(again / "checkpoints/step_10")
    proc = run_cli([*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()),
                    "-m", "distcourse.train", *ARGS, "--tp", "2", "--batch_size", "4", "--save_every", "5",
                    "--resume", "latest", "--output_dir", str(again)], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, got = train_losses(runs / "dp2_tp2"), train_losses(again)
    assert got[:5] == want[:5] and len(got) == 10  # the first 5 steps are the saved run's records
    worst = max(abs(a - b) / abs(a) for a, b in zip(want[5:], got[5:]))
    assert worst <= 1e-4, worst  # the same examples and weights; only the order of a sum differs
    norms = worst_rel(*(train_losses(d, "grad_norm")[5:] for d in (runs / "dp2_tp2", again)))
    assert norms <= NORM_TOL, norms  # the pre-clip gradient norms of steps 6-10 as well
    assert json.loads((again / "run.json").read_text())["parallel"]["dp"] == 1


# dp × tp × pp × cp on 8 processes, the trainer's step (`Mesh`) on its tiny GPT-2, against one process on the same
# global batch: one launch forked from here (no imports repeated), the layouts in turn, a few steps each (8
# trainer processes on 2 cores take a minute). The tiny preset's shape with 4 heads: Ulysses under tp 2 × cp 2
# needs n_head/tp divisible by cp. Clipping at 0.1 acts at every step.
LAYOUTS_4D = {"tp2_pp2_cp2": dict(tp=2, pp=2, cp=2), "dp2_pp2_cp2": dict(pp=2, cp=2),
              "dp2_pp2_cp2_ulysses": dict(pp=2, cp=2, cp_impl="ulysses"),
              "tp2_pp2_cp2_ulysses": dict(tp=2, pp=2, cp=2, cp_impl="ulysses")}
STEPS_4D, GA_4D, CLIP_4D = 3, 2, 0.1  # 1F1B: at least pp micro-batches per step
OPT_4D = dict(lr=3e-3, weight_decay=0.1, warmup_steps=1, max_steps=STEPS_4D, pp_schedule="1f1b")


def batches_4d():
    "STEPS_4D x GA_4D global micro-batches of 4 sequences of 32 tokens, the last target of each -100."
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": x, "labels": x.clone()} for x in
            (torch.randint(0, 100, (4, 32), generator=g) for _ in range(STEPS_4D * GA_4D))]


def one_process_4d(hf, out):
    "Losses and pre-clip gradient norms of one process on batches_4d; step 1's gradients into out/one.pt."
    model = copy.deepcopy(hf)
    opt, batches, losses, norms = make_optimizer(model, OPT_4D["lr"], OPT_4D["weight_decay"]), batches_4d(), [], []
    sched = make_scheduler(opt, OPT_4D["warmup_steps"], STEPS_4D)
    for s in range(STEPS_4D):
        micro = batches[s * GA_4D:(s + 1) * GA_4D]
        n, total = sum(count_targets(b, "clm") for b in micro), 0.0
        for b in micro:
            loss, _ = loss_sum(model, b, "clm")
            (loss / n).backward()
            total += loss.item()
        norms.append(sum(p.grad.pow(2).sum() for p in model.parameters()).sqrt().item())
        if s == 0: torch.save({k: p.grad.clone() for k, p in model.named_parameters()}, out / "one.pt")
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_4D)
        opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
        losses.append(total / n.item())
    return losses, norms


def mesh_4d_worker(out, hf):
    "Worker: every LAYOUTS_4D mesh in turn on batches_4d; rank 0 writes its losses, norms, step 1's gradients."
    dist.init_process_group("gloo")
    all_reduce, groups = dist.all_reduce, []  # the group of every all-reduce call
    def counted(t, *args, group=None, **kw):
        groups.append(group)
        return all_reduce(t, *args, group=group, **kw)
    dist.all_reduce = counted
    for name, kw in LAYOUTS_4D.items():
        mesh, first = Mesh(copy.deepcopy(hf), SimpleNamespace(**{"tp": 1, **kw}, **OPT_4D)), {}
        def keep(mesh, step):  # step 1's summed gradients, before clipping, under GPT-2's names
            if step == 1: first.update(mesh.full_grads())  # a collective: every rank calls it
        groups.clear()
        res = [r for _, r in mesh.train_steps(iter(batches_4d()), STEPS_4D, 0, GA_4D, CLIP_4D, keep)]
        if dist.get_rank() == 0:
            torch.save(first, out / f"{name}.pt")
            (out / f"{name}.json").write_text(json.dumps({"losses": [r["loss"] for r in res],
                                                         "norms": [r["grad_norm"] for r in res],
                                                         "data_calls": sum(g is mesh.g["data"] for g in groups),
                                                         "parallel": {**mesh.d, "cp_impl": mesh.cp_impl}}))
    dist.all_reduce = all_reduce
    dist.barrier()
    dist.destroy_process_group()


def test_4d_meshes_equal_one_process(tmp_path):
    "tp 2 × pp 2 × cp 2 and dp 2 × pp 2 × cp 2, with the ring and with Ulysses: losses, norms, gradients."
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=64, n_layer=2, n_head=4, n_embd=64, resid_pdrop=0,
                                    embd_pdrop=0, attn_pdrop=0))
    want_losses, want_norms = one_process_4d(hf, tmp_path)
    assert min(want_norms) > CLIP_4D  # clipping acts at every step
    launch(partial(mesh_4d_worker, hf=hf), (tmp_path,), num_processes=8, timeout=240)
    for name, kw in LAYOUTS_4D.items():
        got = json.loads((tmp_path / f"{name}.json").read_text())
        losses, norms = worst_rel(want_losses, got["losses"]), worst_rel(want_norms, got["norms"])
        grads = grads_diff(tmp_path / "one.pt", tmp_path / f"{name}.pt")
        print(f"{name}: losses {losses:.1e}, gradient norms {norms:.1e}, step 1's gradients {grads:.1e}")
        assert losses <= 1e-5 and norms <= NORM_TOL and grads <= GRAD_TOL, (name, losses, norms, grads)
        assert got["parallel"] == {"dp": 8 // (kw.get("tp", 1) * 4), "tp": kw.get("tp", 1), "pp": 2, "cp": 2,
                                   "cp_impl": kw.get("cp_impl", "ring")}
        # the gradients and the loss sum: one bucketed all-reduce per step over dp x cp (the tiny model < 25 MiB)
        assert got["data_calls"] == STEPS_4D, got["data_calls"]


@pytest.mark.fast
def test_layout_tp_innermost_pp_outermost():
    "The field's rank order (Megatron-Core's tp-cp-ep-dp-pp, torchtitan's pp, dp, cp, tp): tp fastest, pp slowest."
    lay = mesh_layout(8, tp=2, pp=2)  # dp 2
    assert lay["tp"][0] == [0, 1]  # rank 1 is rank 0's tp neighbour
    assert lay["dp"][0] == [0, 2]  # then the replicas
    assert lay["pp"][0] == [0, 4]  # stage 1 starts at rank 4: stages are the outermost axis
    tp, cp, pp, world = 2, 2, 2, 16  # dp 2
    lay, dp = mesh_layout(world, tp, pp, cp), world // (tp * cp * pp)
    for ranks in lay["tp"]: assert ranks == list(range(ranks[0], ranks[0] + tp))  # consecutive
    for ranks in lay["cp"]: assert ranks == list(range(ranks[0], ranks[0] + cp * tp, tp))
    for ranks in lay["pp"]: assert [r // (world // pp) for r in ranks] == list(range(pp))  # stage = r // (world/pp)
    for p in range(pp):
        for d in range(dp):
            assert lay["dp"][p * cp * tp][d] == ((p * dp + d) * cp) * tp  # ((p·dp + d)·cp + c)·tp + t
    assert mesh_layout(8, pp=2)["pp"] == [[d, d + 4] for d in range(4)]  # the pipeline lesson's pp_groups


BAD = [(["--tp", "3"], 2, "n_head=2 is not divisible by tp=3"),
       (["--tp", "2"], 3, "does not divide the world size 3"),
       (["--pp", "2", "--grad_accum", "1"], 2, "1F1B needs at least as many micro-batches as stages"),
       (["--pp", "4", "--grad_accum", "4"], 4, "n_layer=2 is fewer than pp=4"),
       (["--cp", "2", "--seq_len", "30"], 2, "seq_len=30 is not divisible by 2 x cp = 4"),
       (["--cp", "2", "--tp", "2", "--cp_impl", "ulysses"], 4, "--cp_impl ulysses deals every cp rank whole heads: "
        "n_head/tp = 1 heads do not split over cp=2; use a cp that divides 1, or --cp_impl ring"),
       (["--cp", "2", "--seq_len", "31", "--cp_impl", "ulysses"], 2, "T=31 tokens do not cut into 2 equal chunks"),
       (["--cp_impl", "zigzag"], 1, "--cp_impl 'zigzag': choose one of ring, ulysses"),
       (["--tp", "2", "--task", "cls"], 2, "use --task clm"),
       (["--pp", "2", "--grad_accum", "2", "--pp_schedule", "zigzag"], 2, "choose one of gpipe, 1f1b, interleaved")]


@pytest.mark.fast
@pytest.mark.parametrize("flags,world,msg", BAD)
def test_bad_degrees_refused_before_any_process_group(flags, world, msg, monkeypatch, tmp_path):
    "Parsing alone refuses them (no process group exists here), naming the numbers and the fix."
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")) as e:
        parse_args(["--config", str(ROOT / "configs/tiny.yaml"), *flags, "--output_dir", str(tmp_path / "x")])
    assert not torch.distributed.is_initialized()
    print(e.value)


@pytest.mark.fast
def test_cli_refuses_with_exit_2(tmp_path, capsys, monkeypatch):
    "The command line's entry point says what is wrong on stderr and exits 2, before any process work."
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        main(["--config", str(ROOT / "configs/tiny.yaml"), "--tp", "3", "--output_dir", str(tmp_path / "x")])
    assert e.value.code == 2 and "--tp 3: n_head=2 is not divisible by tp=3" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not torch.distributed.is_initialized()


def _overlapped_main(args, bucket_mb):
    "The trainer's main with `Mesh.bucket_mb` set (a fork of this process: the class attribute goes with it)."
    Mesh.bucket_mb = bucket_mb
    main(args)


@pytest.mark.fast
@pytest.mark.parametrize("bucket_mb", [(25, 1), None])
def test_dp_cp_step_sums_gradients_in_a_few_calls_launched_from_backward(tmp_path, bucket_mb):
    """dp 2 x cp 2, read from the run's own --profile_steps trace: a step makes a handful of all-reduces, not one
    per tensor, and 03's Reducer launches the buckets inside backward; with `bucket_mb=None` (05k's sum after
    backward) none starts there, so the check can fail."""
    from distcourse.profiling import read_trace
    args = ["--config", str(ROOT / "configs/tiny.yaml"), "--cp", "2", "--batch_size", "2", "--seq_len", "32",
            "--max_steps", "3", "--eval_every", "0", "--max_examples", "100", "--tracker", "none",
            "--profile_steps", "2:3", "--output_dir", str(tmp_path)]
    launch(_overlapped_main, (args, bucket_mb), num_processes=4, timeout=240)
    t = read_trace(tmp_path / "traces/rank0.json")
    events = json.loads((tmp_path / "traces/rank0.json").read_text())["traceEvents"]
    calls = [e["ts"] / 1e3 - t["start"] for e in events if e.get("ph") == "X" and e["name"] == "c10d::allreduce_"]
    calls = [c for c in calls if any(s <= c < e for s, e in t["steps"])]
    in_backward = [c for c in calls if any(s <= c < e for s, e in t["backward"])]
    tensors = 4 + 12 * 2  # tiny: wte, wpe, ln_f's 2, 2 blocks of 12 (the head is tied): one call each, were it so
    assert len(t["steps"]) == 2 and 2 * 2 <= len(calls) <= 2 * 4 < tensors, calls  # count, buckets, loss
    assert (len(in_backward) >= 2) == (bucket_mb is not None), (calls, t["backward"])
