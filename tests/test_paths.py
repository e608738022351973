"""Every path of the trainer proved at the gradient, from its command line: each parallel layout against one process
on the same global batch, on what a wrong reduction would change. Per step: the loss and the gradient norm before
clipping (AdamW and clipping hide a gradient wrong by a constant factor from the losses); step 1: every parameter's
full gradient, each tensor against its own norm (a wrong LayerNorm gain hides under 1e-5 of the whole gradient).
A checkpoint saved at one layout resumes at another: steps 2-3 equal an uninterrupted run at the new layout.

The global batch is 4 sequences x 4 micro-batches of 32 tokens in every layout (a 4-block `tiny`: PyTorch's looped
and V schedules need 2 x pp chunks). The fast tier runs one launch per parallelism; the full tier adds every schedule,
4-process layouts and mixed precision. A table of what each path measured is printed after the module."""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import ROOT, print_table, run_cli, trainer_cmd, worst_rel, worst_tensor

TIMEOUT = 240  # seconds per launch: a hang fails
ARGS = ["--config", str(ROOT / "configs/tiny.yaml"), "--n_layer", "4", "--max_steps", "3", "--log_every", "1",
        "--eval_every", "0", "--seq_len", "32", "--max_examples", "300", "--tracker", "none", "--grads_at", "1"]
WHOLE, HALF = ["--batch_size", "4", "--grad_accum", "4"], ["--batch_size", "2", "--grad_accum", "4"]
MOE = ["--model", "tiny-moe", "--n_layer", "0"]  # its preset depth (2 blocks)
DEEPSEEK, ST_DROPLESS = ["--router", "deepseek"], ["--router", "st-moe", "--dropless"]
FP32, BF16 = ["--mixed_precision", "no"], ["--mixed_precision", "bf16"]
AC = ["--activation_checkpointing", "true"]
# Measured 2026-11-28 on 2 CPU cores, fp32: losses within 2e-7, norms within 2e-7 relative, every tensor of step 1
# within 2e-6 of its own norm (the worst: a LayerNorm bias, summed in another order).
LOSS_TOL = NORM_TOL = 1e-5
GRAD_TOL = 1e-5

# name -> (processes, flags, the one-process reference it is compared with, tier)
PATHS = {
    "dp2": (2, HALF, "one", "fast"),
    "zero1": (2, [*HALF, "--zero_stage", "1"], "one", "fast"),
    "zero2": (2, [*HALF, "--zero_stage", "2"], "one", "fast"),
    "zero3": (2, [*HALF, "--zero_stage", "3"], "one", "fast"),
    "tp2": (2, [*WHOLE, "--tp", "2"], "one", "fast"),
    "pp2 1f1b": (2, [*WHOLE, "--pp", "2", "--pp_schedule", "1f1b"], "one", "fast"),
    "pp2 interleaved": (2, [*WHOLE, "--pp", "2", "--pp_schedule", "interleaved"], "one", "fast"),
    "cp2 ring": (2, [*WHOLE, "--cp", "2", "--cp_impl", "ring"], "one", "fast"),
    "cp2 ulysses": (2, [*WHOLE, "--cp", "2", "--cp_impl", "ulysses"], "one", "fast"),
    "ep2": (2, [*MOE, *HALF, "--ep", "2"], "one moe", "fast"),
    "tp2 moe": (2, [*MOE, *WHOLE, "--tp", "2"], "one moe", "fast"),  # attention split, every expert on both ranks
    "ac": (1, [*WHOLE, *AC], "one", "fast"),
    "dp2 ac": (2, [*HALF, *AC], "one", "full"),
    "pp2 gpipe": (2, [*WHOLE, "--pp", "2", "--pp_schedule", "gpipe"], "one", "full"),
    "pp2 zb": (2, [*WHOLE, "--pp", "2", "--pp_schedule", "zb"], "one", "full"),
    "pp2 zbv": (2, [*WHOLE, "--pp", "2", "--pp_schedule", "zbv"], "one", "full"),
    "pp2 dualpipev": (2, [*WHOLE, "--pp", "2", "--pp_schedule", "dualpipev"], "one", "full"),
    "dp2 pp2": (4, [*HALF, "--pp", "2"], "one", "full"),  # the pp x dp loss scale is not 1
    "dp4": (4, ["--batch_size", "1", "--grad_accum", "4"], "one", "full"),
    "dp2 tp2": (4, [*HALF, "--tp", "2"], "one", "full"),
    "tp2 cp2": (4, [*WHOLE, "--tp", "2", "--cp", "2"], "one", "full"),
    # activation checkpointing on the mesh: tp's blocks replay their heads' dropout state, cp's recompute their
    # ring, PyTorch's V schedule splits backward into input and weight gradients over recomputed blocks
    "tp2 ac": (2, [*WHOLE, "--tp", "2", *AC], "one", "full"),
    "tp2 cp2 ac": (4, [*WHOLE, "--tp", "2", "--cp", "2", *AC], "one", "full"),
    "pp2 zbv ac": (2, [*WHOLE, "--pp", "2", "--pp_schedule", "zbv", *AC], "one", "full"),
    # PyTorch's schedules over tp copies and cp chunks: the V splits backward into input and weight gradients
    # around tp's all-reduces and cp's ring
    "tp2 pp2 zbv": (4, [*WHOLE, "--tp", "2", "--pp", "2", "--pp_schedule", "zbv"], "one", "full"),
    # both: each split backward recomputes a block twice (B, then W), replaying tp's dropout state both times
    "tp2 pp2 zbv ac": (4, [*WHOLE, "--tp", "2", "--pp", "2", "--pp_schedule", "zbv", *AC], "one", "full"),
    "cp2 pp2 zbv": (4, [*WHOLE, "--cp", "2", "--pp", "2", "--pp_schedule", "zbv"], "one", "full"),  # chunks on T/cp
    # ZeRO on the mesh: FSDP2 over the data axes (07c's apply_fsdp), dp or dp x cp, around tp's and cp's collectives
    # (cp 2 on 2 processes: dp 1, so FSDP2 shards over the flattened dp x cp = 2 ranks)
    "cp2 zero2": (2, [*WHOLE, "--cp", "2", "--zero_stage", "2"], "one", "fast"),
    # ZeRO-1 on the mesh: 05a's flat AdamW over the same data axes (07c's apply_zero1), gradients all-reduced whole
    "cp2 zero1": (2, [*WHOLE, "--cp", "2", "--zero_stage", "1"], "one", "fast"),
    "dp2 tp2 zero1": (4, [*HALF, "--tp", "2", "--zero_stage", "1"], "one", "full"),
    "dp2 pp2 zbv zero1": (4, [*HALF, "--pp", "2", "--pp_schedule", "zbv", "--zero_stage", "1"], "one", "full"),
    "dp2 tp2 zero3": (4, [*HALF, "--tp", "2", "--zero_stage", "3"], "one", "full"),
    # and around the pipeline's schedules: one unit per stage or chunk; the tied copies' rows summed across stages
    "dp2 pp2 zero3": (4, [*HALF, "--pp", "2", "--zero_stage", "3"], "one", "full"),  # the course's 1F1B
    "dp2 pp2 zbv zero2": (4, [*HALF, "--pp", "2", "--pp_schedule", "zbv", "--zero_stage", "2"], "one", "full"),
    # experts with tp (05m): attention split over tp, each expert whole on its tp ranks; all-to-all over the ep ranks
    # of one tp index, experts' gradients summed over their copies, the norm counting each expert once
    "ep2 tp2": (4, [*MOE, *HALF, "--ep", "2", "--tp", "2"], "one moe", "full"),
    "ep2 ac": (2, [*MOE, *HALF, "--ep", "2", *AC], "one moe", "full"),  # each block's all-to-alls replayed
    # lesson 05jb's routers: DeepSeek-V3's sigmoid gates and bias (moved by the loads summed over both ranks), and
    # ST-MoE's z-loss with no capacity; step 1's gradients reach the router through the new gates and losses
    "ep2 deepseek": (2, [*MOE, *HALF, "--ep", "2", *DEEPSEEK], "one deepseek", "full"),
    "ep2 st-moe dropless": (2, [*MOE, *HALF, "--ep", "2", *ST_DROPLESS], "one st-moe dropless", "full"),
    "pp2 zbv zero2": (2, [*WHOLE, "--pp", "2", "--pp_schedule", "zbv", "--zero_stage", "2"], "one", "fast"),  # dp 1
}
REFERENCES = {"one": (1, WHOLE), "one moe": (1, [*MOE, *WHOLE]), "one deepseek": (1, [*MOE, *WHOLE, *DEEPSEEK]),
              "one st-moe dropless": (1, [*MOE, *WHOLE, *ST_DROPLESS])}
# Equal to one process holds with a flag silently ignored too: a rank must keep fewer bytes for backward than the
# same layout without the flag (run.json's activation_bytes): recomputation keeps block inputs only; under
# PyTorch's schedules tp keeps its heads' and MLP columns' share, cp its chunk of the sequence.
LESS = {"ep2 ac": "ep2", "tp2 ac": "tp2", "tp2 cp2 ac": "tp2 cp2", "pp2 zbv ac": "pp2 zbv", "tp2 pp2 zbv": "pp2 zbv",
        "cp2 pp2 zbv": "pp2 zbv", "tp2 pp2 zbv ac": "tp2 pp2 zbv"}
# ZeRO on the mesh holds less, not only the same numbers: FSDP2 over 2 data ranks leaves each rank half of AdamW's
# moments (run.json's first-step peak, OPT; measured 2026-11-29: dp2 pp2 9.37 MB -> dp2 pp2 zero3 4.69 MB a rank);
# ZeRO-1 halves the moments but adds 05a's flat fp32 slice of the weights (measured: 0.88 of cp2's, 0.83 of dp2 tp2's).
# (Not under PyTorch's schedules, whose first step is not measured: see Mesh.peak_first.) name -> (without, at most)
SHARDED = {"cp2 zero1": ("cp2 ring", 0.95), "dp2 tp2 zero1": ("dp2 tp2", 0.95), "cp2 zero2": ("cp2 ring", 0.6),
           "dp2 tp2 zero3": ("dp2 tp2", 0.6), "dp2 pp2 zero3": ("dp2 pp2", 0.6)}
# Mixed precision, by FlashAttention's rule: a parallel bf16 run's error against the fp32 one-process run is at most
# twice the one-process bf16 run's error against it (bf16 rounds; the question is whether sharding rounds worse).
# Smaller (2 steps, 4 sequences, one micro-batch): a CPU without native bf16 (AVX2 only) multiplies bf16 matrices
# some 60x slower than fp32 ones (a 1024 x 1024 matmul: 4 s against 0.07 s, measured 2026-11-28 on an AMD EPYC).
SMALL = ["--max_steps", "2", "--grad_accum", "1"]
BF16_PATHS = {"bf16 zero2": (2, [*SMALL, "--batch_size", "2", "--zero_stage", "2", *BF16]),
              "bf16 zero3": (2, [*SMALL, "--batch_size", "2", "--zero_stage", "3", *BF16])}
# Resume at another layout: the source saves every step (dcp: one process's names, whole tensors; DDP: Accelerate's
# whole files), its step-1 checkpoint is resumed by the target's flags in a fresh output_dir, and steps 2-3 are
# compared with the target's uninterrupted run: the same data position, weights, AdamW moments and step count, and
# learning rate. Measured 2026-11-28 on 2 CPU cores: 0 on the first five, and on DDP -> tp 2 and pp 2 losses 0, norms
# <= 6.6e-8 (AdamW's first update moves each weight by about lr whatever the last bits of its gradient, so step 1 at
# another layout leaves the same weights); a lost step count or schedule is caught by tests/test_mutation.py's "tp2
# to one" (and, planted by hand in load_into_mesh, by "dp2 to tp2": step-3 loss 1.9e-3, lr one step behind).
# source -> target, both in PATHS (or "one")
RESUMES = {"tp2 to one": ("tp2", "one"), "pp2 1f1b to one": ("pp2 1f1b", "one"), "cp2 ring to one": ("cp2 ring", "one"),
           "dp2 tp2 to dp4": ("dp2 tp2", "dp4"), "zero3 to dp2": ("zero3", "dp2"),
           "dp2 to tp2": ("dp2", "tp2"), "dp2 to pp2 1f1b": ("dp2", "pp2 1f1b"),  # DDP's whole files, cut
           "dp2 tp2 zero3 to dp4": ("dp2 tp2 zero3", "dp4"),  # FSDP2's shards gathered into one process's
           "dp2 tp2 to dp2 tp2 zero3": ("dp2 tp2", "dp2 tp2 zero3"),  # and cut into FSDP2's rows
           "dp2 pp2 zero3 to dp4": ("dp2 pp2 zero3", "dp4"),  # each stage's FSDP2 rows gathered
           "ep2 tp2 to ep2 tp2": ("ep2 tp2", "ep2 tp2"),  # experts' own layout: a piece per ep and tp rank
           "dp2 tp2 zero1 to dp4": ("dp2 tp2 zero1", "dp4"),  # ZeRO-1's flat slices gathered, per parameter
           "dp2 tp2 to dp2 tp2 zero1": ("dp2 tp2", "dp2 tp2 zero1")}  # and cut into flat slices  # experts' own layout: a piece per ep and tp rank
SAVES = ["--save_every", "1"]
BF16_REFERENCES = {"fp32": (1, [*SMALL, "--batch_size", "4", *FP32]), "bf16": (1, [*SMALL, "--batch_size", "4", *BF16])}
ROWS = []  # (path, processes, losses, norms, worst tensor (name)): printed after the module


def records(out, key) -> list:
    return [r[key] for r in map(json.loads, open(out / "metrics.jsonl")) if "split" not in r]


def train(tmp, name, world, flags):
    "The trainer on `world` processes into tmp/<name>; None when it ran, else why not."
    out = tmp / name.replace(" ", "_")
    try: proc = run_cli([*trainer_cmd(world, TIMEOUT), *ARGS, *flags, "--output_dir", str(out)], timeout=TIMEOUT + 30)
    except Exception as e: return f"{type(e).__name__}: {e}"
    return None if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr[-2000:]}"


def requested(request, test) -> list:
    "The `name` parameters of this module's selected items of `test` (the fast tier selects fewer)."
    return [i.callspec.params["name"] for i in request.session.items
            if i.module is request.module and i.originalname == test]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    "Every selected path and the references they need, two launches at a time: {name: output dir or failure}."
    tmp = tmp_path_factory.mktemp("paths")
    names = requested(request, "test_path_equals_one_process")
    names += [m for n in requested(request, "test_flag_changes_the_piece") for m in (n, LESS[n])]
    names += [m for n in requested(request, "test_zero_shards_the_optimizer") for m in (n, SHARDED[n][0])]
    resumes = {n: RESUMES[n] for n in requested(request, "test_resume_at_another_layout")}
    names += [m for pair in resumes.values() for m in pair if m in PATHS]
    paths = {n: PATHS[n] for n in names}
    jobs = {ref: REFERENCES[ref] for ref in {p[2] for p in paths.values()} | {t for _, t in resumes.values()}
            if ref in REFERENCES}
    jobs |= {n: p[:2] for n, p in paths.items()}
    saving = {source for source, _ in resumes.values()}  # every step saved: no change to the math
    jobs |= {n: (w, [*flags, *SAVES]) for n, (w, flags) in jobs.items() if n in saving}
    if requested(request, "test_bf16_path_by_flashattention_rule"):
        bf16 = requested(request, "test_bf16_path_by_flashattention_rule")
        jobs |= BF16_REFERENCES | {n: BF16_PATHS[n] for n in bf16}
    with ThreadPoolExecutor(2) as pool:  # a launch is mostly imports and process starts, one core each
        futures = {n: pool.submit(train, tmp, n, world, flags) for n, (world, flags) in jobs.items()}
        failed = {n: f.result() for n, f in futures.items()}
    done = {n: failed[n] or tmp / n.replace(" ", "_") for n in jobs}
    with ThreadPoolExecutor(2) as pool:  # each from its source's step-1 checkpoint, at its target's flags
        futures = {n: pool.submit(resume, tmp, n, done[source], *spec(target))
                   for n, (source, target) in resumes.items() if not isinstance(done[source], str)}
        failed = {n: f.result() for n, f in futures.items()}
    return done | {n: failed.get(n, f"its source failed: {done[s]}") or tmp / n.replace(" ", "_")
                   for n, (s, _) in resumes.items()}


def spec(name) -> tuple:
    "(processes, flags) of a path or a reference."
    return PATHS[name][:2] if name in PATHS else REFERENCES[name]


def resume(tmp, name, source, world, flags):
    "`source`'s step-1 checkpoint resumed on `world` processes with `flags`, into tmp/<name>; None when it ran."
    return train(tmp, name, world, [*flags, "--resume", str(source / "checkpoints/step_1")])


def output(runs, name):
    got = runs[name]
    assert not isinstance(got, str), f"{name}: the run failed: {got}"
    return got


def measure(runs, name, ref) -> tuple:
    "(worst relative loss, worst relative norm, (worst tensor's relative error, its name)) of `name` vs `ref`."
    want, got = output(runs, ref), output(runs, name)
    losses = worst_rel(records(want, "loss"), records(got, "loss"))
    norms = worst_rel(records(want, "grad_norm"), records(got, "grad_norm"))
    return losses, norms, worst_tensor(want / "grads_step1.pt", got / "grads_step1.pt")


@pytest.fixture(scope="module", autouse=True)
def table(request):
    "After the module: what each path measured against its reference."
    yield
    print_table(request, ["path (processes): worst relative loss, pre-clip norm (3 steps), worst tensor of step 1 "
                          "(own norm)"] * bool(ROWS)
                + ["{:16} ({}): {:.1e}, {:.1e}, {:.1e} ({})".format(*row) for row in ROWS])


def tier(name, spec):
    return pytest.param(name, id=name, marks=[pytest.mark.fast] if spec[-1] == "fast" else [])


@pytest.mark.parametrize("name", [tier(n, p) for n, p in PATHS.items()])
def test_path_equals_one_process(runs, name):
    "Every step's loss and pre-clip norm, and each tensor of step 1's full gradient, against one process."
    world, _, ref, _ = PATHS[name]
    losses, norms, (grads, where) = measure(runs, name, ref)
    ROWS.append((name, world, losses, norms, grads, where))
    assert len(records(output(runs, name), "loss")) == 3  # every step logged
    assert losses <= LOSS_TOL and norms <= NORM_TOL and grads <= GRAD_TOL, (name, losses, norms, grads, where)


@pytest.mark.parametrize("name", list(LESS))
def test_flag_changes_the_piece(runs, name):
    "A rank of `name` keeps fewer activation bytes than the same layout without the flag (read from run.json)."
    got, without = (json.loads((output(runs, n) / "run.json").read_text())["memory"]["activation_bytes"]
                    for n in (name, LESS[name]))
    print(f"{name}: activation_bytes {got:,} against {without:,} ({LESS[name]})")
    assert 0 < got < without, (name, got, without)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.fast] * (PATHS[n][-1] == PATHS[w][-1] == "fast"))
                                  for n, (w, _) in SHARDED.items()])
def test_zero_shards_the_optimizer(runs, name):
    "A rank of `name` keeps less of AdamW's state than the same layout without ZeRO keeps (2 data ranks)."
    ref, most = SHARDED[name]
    got, without = (json.loads((output(runs, n) / "run.json").read_text())["memory"]["peak_first_step"]["cpu"]["OPT"]
                    for n in (name, ref))
    print(f"{name}: AdamW state {got:,} B against {without:,} B ({ref}): {got / without:.2f}")
    assert got < most * without, (name, got, without)


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_at_another_layout(runs, name):
    "Steps 2-3 of a run resumed from another layout's step-1 checkpoint equal the new layout's uninterrupted run."
    source, target = RESUMES[name]
    got, want = output(runs, name), output(runs, target)
    assert json.loads((got / "run.json").read_text())["resumed_from"]["step"] == 1
    assert records(got, "step") == [2, 3]  # the saved step's record stays in the source's run
    for key in ("lr", "tokens"):  # the schedule after each step, the tokens seen: restored, not restarted
        assert records(got, key) == records(want, key)[1:], (key, records(got, key), records(want, key))
    losses = worst_rel(records(want, "loss")[1:], records(got, "loss"))
    norms = worst_rel(records(want, "grad_norm")[1:], records(got, "grad_norm"))
    ROWS.append((name, spec(target)[0], losses, norms, float("nan"), "steps 2-3 after the resume"))
    assert losses <= LOSS_TOL and norms <= NORM_TOL, (name, losses, norms)


@pytest.mark.parametrize("name", list(BF16_PATHS))
def test_bf16_path_by_flashattention_rule(runs, name):
    "A bf16 parallel run is no further from fp32 than twice one bf16 process is, on norms and on every tensor."
    _, base_norms, (base_grads, _) = measure(runs, "bf16", "fp32")
    _, norms, (grads, where) = measure(runs, name, "fp32")
    ROWS.append((name, BF16_PATHS[name][0], float("nan"), norms, grads, where))
    print(f"{name}: vs fp32 norms {norms:.1e} (one bf16 process {base_norms:.1e}), worst tensor {grads:.1e} "
          f"({where}; one bf16 process {base_grads:.1e})")
    assert base_grads > 1e-4, "the bf16 reference ran in fp32: the rule would compare nothing"
    assert norms <= 2 * base_norms and grads <= 2 * base_grads, (name, norms, base_norms, grads, base_grads)
