"""Faults injected, faults caught: each known fault, written into a fresh copy of the package,
makes the smallest equivalence check that must see it fail; the same check passes on the package as
it is.

Every check compares a few steps with one process on the same global batch (or a straight run with
its resumed copy): per-step loss and gradient norm before clipping. A loss alone cannot see a
gradient scaled by a constant (AdamW and clipping absorb it); a norm can. Most checks are the
trainer's command line against a one-process run of the package as it is; a few are a lesson's
worker, which runs its own one-process reference beside the parallel version and writes both.

The fast tier runs three faults (dp, tp, resume), their checks and `zero2 muon`, and reads every fault's text
(`test_fault_still_applies`, no run); the full tier runs every fault and every check."""
import json
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest

from conftest import PY, ROOT, copy_env, fresh_copy, print_table, run_cli, trainer_cmd

TIMEOUT = 240  # seconds per launch: a hang fails
# 3 steps of the tiny model (4 blocks or tiny-moe where a layout says so); the global batch is 4 x 2 sequences
# of 32 tokens in every layout below
ARGS = ["--config", str(ROOT / "configs/tiny.yaml"), "--max_steps", "3", "--log_every", "1",
        "--eval_every", "0", "--seq_len", "32", "--max_examples", "200", "--tracker", "none"]
HALF, WHOLE = ["--batch_size", "2", "--grad_accum", "2"], ["--batch_size", "4", "--grad_accum", "2"]
FOUR = ["--n_layer", "4"]  # PyTorch's looped and V schedules cut the blocks into pp x 2 chunks
MOE = ["--model", "tiny-moe"]  # lesson 05m's ExpertMesh
# lesson 05jb's routers: DeepSeek-V3's (its bias moved after each step by the global batch's load, which changes
# the choices of steps 2 and 3), and ST-MoE's z-loss with no capacity (every token reaches its expert)
DEEPSEEK, ST_DROPLESS = ["--router", "deepseek"], ["--router", "st-moe", "--dropless"]
LOSS_TOL = NORM_TOL = 1e-5  # relative, per step (every path's norm is the root of summed squares)
# Muon's Newton-Schulz runs in bf16 (torch's): the 2-rank sum's last-bit differences move its steps by ~1e-5
# (1.3e-5 measured at step 3); the Muon faults below move them by 2e-2 and more
TOLERANCES = {"dp2 muon": 1e-4, "zero2 muon": 1e-4, "zero3 muon 4": 1e-4}
# reference name -> one process's flags; "one" is saved at every step: `resume` resumes a copy of it
# lesson 05aa's MuonAdamW and schedule; 4 steps, all of them changing the rate (warmup 3), so that a run resumed
# at step 1 shows its step-3 learning rate in step 4's loss
MUON = ["--optimizer", "muon", "--schedule", "wsd", "--max_steps", "4", "--warmup_steps", "3"]
REFERENCES = {"one": [*WHOLE, "--save_every", "1"], "one4": [*WHOLE, *FOUR], "one moe": [*WHOLE, *MOE],
              "one muon": [*WHOLE, *MUON, "--save_every", "1", "--keep_checkpoints", "4"],
              "one deepseek": [*WHOLE, *MOE, *DEEPSEEK], "one st-moe dropless": [*WHOLE, *MOE, *ST_DROPLESS]}
# check name -> (processes, flags, the reference it is compared with): the trainer CLI
LAYOUTS = {"dp2": (2, HALF, "one"),  # 2 replicas of 2 x 2 sequences
           "zero1": (2, ["--zero_stage", "1", *HALF], "one"),
           "zero2": (2, ["--zero_stage", "2", *HALF], "one"),  # FSDP2
           "zero3": (2, ["--zero_stage", "3", *HALF], "one"),  # FSDP2, resharded after forward
           "tp2": (2, ["--tp", "2", *WHOLE], "one"),  # one tp pair: 4 x 2 sequences
           "cp2": (2, ["--cp", "2", *WHOLE], "one"),  # --cp_impl ring: lesson 05h's lean ring
           "cp2 ulysses": (2, ["--cp", "2", "--cp_impl", "ulysses", *WHOLE], "one"),
           "pp2": (2, ["--pp", "2", "--pp_schedule", "1f1b", *WHOLE], "one"),
           "pp2 interleaved": (2, [*FOUR, "--pp", "2", "--pp_schedule", "interleaved", *WHOLE], "one4"),
           "pp2 zbv": (2, [*FOUR, "--pp", "2", "--pp_schedule", "zbv", *WHOLE], "one4"),  # rank 0: both tied
           "dp2 pp2": (4, ["--pp", "2", "--pp_schedule", "1f1b", *HALF], "one"),  # local / n: 1/2 (1 at dp 1)
           "ep2": (2, [*MOE, "--ep", "2", *HALF], "one moe"),  # 2 of the 4 experts per rank
           "tp2 moe": (2, [*MOE, "--tp", "2", *WHOLE], "one moe"),  # attention split, every expert on both ranks
           "ep2 deepseek": (2, [*MOE, *DEEPSEEK, "--ep", "2", *HALF], "one deepseek"),
           "ep2 st-moe dropless": (2, [*MOE, *ST_DROPLESS, "--ep", "2", *HALF], "one st-moe dropless"),
           "tp2 deepseek": (2, [*MOE, *DEEPSEEK, "--tp", "2", *WHOLE], "one deepseek"),  # a tp pair: one batch's load
           "cp2 zero2": (2, ["--cp", "2", "--zero_stage", "2", *WHOLE], "one"),  # FSDP2 over dp x cp = 2 (07c)
           "dp2 pp2 zero2": (4, ["--pp", "2", "--pp_schedule", "1f1b", "--zero_stage", "2", *HALF], "one"),
           "cp2 zero1": (2, ["--cp", "2", "--zero_stage", "1", *WHOLE], "one"),  # 05a's flat AdamW over dp x cp
           "dp2 muon": (2, [*MUON, *HALF], "one muon"),  # each rank orthogonalises the all-reduced gradient
           "zero2 muon": (2, ["--zero_stage", "2", *MUON, *HALF], "one muon"),  # 05aa: one owner per matrix
           "zero3 muon 4": (4, ["--zero_stage", "3", *MUON, "--batch_size", "1", "--grad_accum", "2"], "one muon")}


def fault(name, module, old, new, check, what):  # old: text that occurs exactly once in the module
    "One fault: replace `old` by `new` in distcourse/<module>.py; `check` must then fail."
    return dict(name=name, module=module, old=old, new=new, check=check, what=what)


FAULTS = [
    fault("router: bias by the rank's own load", "router", "if group is not None: dist.all_reduce(counts, group=group)",
          "pass", "ep2 deepseek", "each rank moves its experts' biases by the load of its own sequences"),
    fault("router: z-loss left out", "router", "(self.z_weight * z_loss(logits) if self.z_weight else 0)", "0",
          "ep2 st-moe dropless", "ST-MoE's router z-loss not added (its flag silently ignored)"),
    fault("dp: mean where sum", "ddp", "scale = accelerator.num_processes * accelerator.grad",
          "scale = accelerator.grad", "dp2", "DDP's mean over ranks not undone (x N dropped)"),
    fault("dp: sum where mean", "zero", "reduce_scatter_single(out, flat.div_(self.world), group",
          "reduce_scatter_single(out, flat, group", "zero2_by_hand",
          "ZeRO-2 by hand reduce-scatters the sum of the ranks' mean gradients"),
    fault("tp: mean where sum", "tensor_parallel",
          'return all_reduce_(grad.contiguous(), ctx.group, "backward", ctx.log), None, None',
          'return all_reduce_(grad.contiguous(), ctx.group, "backward", ctx.log)'
          " / dist.get_world_size(ctx.group), None, None", "tp2",
          "f's backward all-reduce divided by tp"),
    fault("tp: sum where mean", "tensor_parallel",  # g keeps its group for the backward
          "def forward(ctx, x, group, log): "
          'return all_reduce_(x.contiguous(), group, "forward", log)'
          "\n    @staticmethod\n    def backward(ctx, grad): return grad, None, None",
          "def forward(ctx, x, group, log):\n        ctx.group = group\n"
          '        return all_reduce_(x.contiguous(), group, "forward", log)\n    @staticmethod\n'
          "    def backward(ctx, grad): "
          'return all_reduce_(grad.clone(), ctx.group, "backward", None), None, None',
          "tp2", "g's backward sums the tp ranks' equal copies of the gradient"),
    fault("cp: mean where sum", "mesh", "    if on_grads: on_grads(self)\n",
          '    for g in grads: g.div_(self.d["cp"])\n    if on_grads: on_grads(self)\n', "cp2",
          "the chunks' gradients averaged over cp"),
    fault("cp: sum where mean", "mesh", "    sq = sum(sq.values())\n",
          '    sq = sum(sq.values())\n'
          '    if self.d["cp"] > 1: dist.all_reduce(sq, group=self.g["cp"])\n',
          "cp2", "the norm's squares summed over cp ranks that each hold the whole gradient"),
    fault("pp: mean where sum", "pipeline", "else grad, group=groups.embed)",
          "else grad, group=groups.embed); grad.div_(2)", "pp2",
          "the tied matrix's two stage gradients averaged"),
    fault("pp: sum where mean", "mesh", '(pp > 1 and n.endswith("lm_head.weight"))', "False", "pp2",
          "the tied matrix's squares summed over first and last stage (counted twice)"),
    fault("local token count", "ddp", 'n = accelerator.reduce(local.to(accelerator.device), "sum")',
          "n = local.to(accelerator.device)", "dp2", "loss divided by this rank's tokens"),
    fault("micro-batch dropped", "ddp", "micro = [next(batches) for _ in range(grad_accum)]",
          "micro = [next(batches) for _ in range(grad_accum)][1:]", "dp2",
          "each step's first micro-batch read but not trained on"),
    fault("tied sync removed", "pipeline",
          "dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=groups.embed)", "pass", "pp2", "wte (first stage) and lm_head (last) keep their own gradients"),
    fault("zig-zag shifted", "context_parallel",
          "return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in ids])",
          "return (torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in ids]) + c) % T", "cp2",
          "every rank's positions one chunk later (mod T)"),
    fault("ZeRO shard offset", "zero",
          "lo, hi = self.rank * s.numel(), (self.rank + 1) * s.numel()",
          "lo, hi = self.rank * s.numel() + 1, (self.rank + 1) * s.numel() + 1", "zero1",
          "ZeRO-1 by hand: every rank's slice one element late"),
    fault("resume data off by one", "checkpoint",
          "self.epoch, self.batch, self._it = epoch, batch, None",
          "self.epoch, self.batch, self._it = epoch, batch + 1, None", "resume",
          "a resumed stream skips one batch"),
    # lesson 05h's lean ring (the trainer's --cp_impl ring): its backward rebuilds P from the saved lse
    fault("ring: rowsum term dropped", "ring_memory", "ds = p * (dout @ v.transpose(-2, -1) - D)",
          "ds = p * (dout @ v.transpose(-2, -1))", "cp2", "dS = P * dP, without FlashAttention-2's - rowsum(dO * O)"),
    fault("ring: dK/dV one rank off", "ring_memory",
          "        if back: dkv = _arrived(back)\n", "        if back: _arrived(back)\n", "cp2",
          "the last hop home dropped: each rank returns its neighbour's K/V gradient as its own"),
    fault("ulysses: pieces one rank off", "ulysses", "return torch.cat(recv.unbind(0), dim=gather)",
          "return torch.cat(recv.roll(1, 0).unbind(0), dim=gather)", "cp2 ulysses",
          "each all-to-all joins what rank i sent at place i + 1"),
    fault("ulysses: backward divided by cp", "ulysses",
          'return _a2a(grad, gather, scatter, ctx.group, ctx.stats, "grad_a2a")',
          'return _a2a(grad, gather, scatter, ctx.group, ctx.stats, "grad_a2a") / dist.get_world_size(ctx.group)',
          "cp2 ulysses", "the all-to-all's backward, a permutation, divided by cp as if it averaged"),
    fault("ep: experts summed over all ranks", "expert_mesh",
          '_all_reduce_flat([p.grad for p in grads if id(p) not in experts], self.g["data"])',
          '_all_reduce_flat([p.grad for p in grads], self.g["data"])', "ep2",
          "each rank's experts' gradients added to the other rank's (other) experts'"),
    fault("ep: aux over this rank's sequences", "expert_mesh", "n, self.seqs = n[0], int(n[1])",
          "n, self.seqs = n[0], int(n[1]) // self.world", "ep2",
          "the load-balancing loss's share taken of 1/world of the global batch's sequences (x world)"),
    fault("ep: norm mean where sum", "mesh", "dist.all_reduce(sq[kind], group=group)",
          "dist.all_reduce(sq[kind], group=group); sq[kind] /= dist.get_world_size(group)",
          "ep2", "the experts' squares averaged over ep ranks that hold different experts"),
    fault("schedules: tied sync mean where sum", "schedules",
          "elif ends: sync_tied(ends[0], groups)",
          "elif ends: sync_tied(ends[0], groups); ends[0].transformer.wte.weight.grad.div_(2) if ends[0].is_first "
          "else ends[0].lm_head.weight.grad.div_(2)", "pp2 interleaved",
          "looped chunks: the first and last rank's tied copies averaged"),
    fault("schedules: V tied copies averaged", "schedules", "total = tied[0].grad + tied[1].grad",
          "total = (tied[0].grad + tied[1].grad) / 2", "pp2 zbv", "V-shape: rank 0's two tied copies averaged"),
    fault("Chunks.step: micro-batch divisor", "schedules",
          "(x, y), self.n, losses = (torch.cat(t) for t in zip(*micro)), n, []",
          "(x, y), self.n, losses = (torch.cat(t) for t in zip(*micro)), n / len(micro), []", "pp2 interleaved",
          "each micro-batch's loss share divided by 1/m of the step's tokens (x m)"),
    fault("FSDP2: sum where mean", "zero", "return fully_shard(model, **kw)",
          "model = fully_shard(model, **kw)\n    for m in model.modules():\n"
          '        if hasattr(m, "set_gradient_divide_factor"):\n'
          "            m.set_force_sum_reduction_for_comms(True)\n"  # gloo has no PREMUL_SUM: SUM, then / 1
          "            m.set_gradient_divide_factor(1.0)\n    return model",
          "zero3", "the reduce-scatter sums the ranks' gradients; the trainer's x N expects FSDP2's mean"),
    fault("FSDP2: precision test inverted", "zero",
          "policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()",
          "policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if not bf16 else MixedPrecisionPolicy()",
          "zero2", "an fp32 run computes with bf16 copies of its fp32 shards"),
    fault("sp: row-parallel bias not summed", "sequence_parallel",
          'if ".ln_" in name or name.endswith("c_proj.bias"): p.register_hook(edges.sum_grad)',
          'if ".ln_" in name: p.register_hook(edges.sum_grad)', "sp2",
          "c_proj's bias sees this rank's chunk of T: its partial gradient kept"),
    fault("sp: reduce-scatter mean where sum", "sequence_parallel",
          'grad_x = _reduce_scatter(grad @ weight, ctx.group, "backward", ctx.log)',
          'grad_x = _reduce_scatter(grad @ weight, ctx.group, "backward", ctx.log) / dist.get_world_size(ctx.group)',
          "sp2", "a column layer's input gradient averaged over tp"),
    fault("tp norm: shards not summed", "mesh", "dist.all_reduce(sq[kind], group=group)",
          "pass", "tp2", "the split tensors' squares of this rank only"),
    fault("tp norm: whole tensors x tp", "mesh",
          'return "split" if self.d["tp"] > 1 and is_split(self.model, name) else "whole"',
          'return "split" if self.d["tp"] > 1 else "whole"', "tp2", "the replicated tensors' squares summed over tp"),
    fault("tp_grad_norm: mean where sum", "tensor_parallel",
          "dist.all_reduce(split, group=group)  # one number per rank",
          "dist.all_reduce(split, group=group); split /= dist.get_world_size(group)", "sp2",
          "lesson 05c's norm averages the shards' squares over tp"),
    fault("pp x dp: loss scale dropped", "mesh", "self.scale = local / n", "self.scale = 1.0", "dp2 pp2",
          "each pipeline's own mean kept (local / n is 1 at dp 1 only): summed over dp, x dp"),
    fault("mesh buckets: mean where sum", "ddp", "        dist.all_reduce(flat, group=group)\n",
          "        dist.all_reduce(flat, group=group)\n        flat.div_(dist.get_world_size(group))\n", "dp2 pp2",
          "the mesh's bucketed gradient sum (03's all_reduce_buckets) averaged over dp x cp"),
    fault("mesh buckets: 1-D tensors left out", "ddp", "if p.requires_grad]  # a tied tensor once, no frozen one",
          "if p.requires_grad and p.dim() > 1]", "cp2",
          "03's Reducer leaves biases and norms out of its buckets: each cp rank keeps its chunk's gradient of them"),
    fault("mesh FSDP2: mean where sum", "engine", "            unit.set_gradient_divide_factor(1.0)\n", "",
          "cp2 zero2", "FSDP2's default reduction on the mesh: each gradient averaged over dp x cp, not summed"),
    fault("mesh FSDP2: norm of one shard", "mesh", "    if self.fsdp: dist.all_reduce(sq, group=self.g[\"data\"])",
          "    pass", "cp2 zero2", "the gradient norm of this rank's FSDP2 shards only, not summed over dp x cp"),
    fault("mesh ZeRO-1: gradients left unsummed", "mesh", "if self.reducer: self.reducer.finish()",
          'if self.reducer and type(self.opt).__name__ != "FlatZeroOptimizer": self.reducer.finish()\n'
          "    elif self.reducer: self.reducer.works.clear()", "cp2 zero1",
          "ZeRO-1 taken for FSDP2: the buckets' sums dropped, its flat AdamW steps on each cp rank's own gradients"),
    fault("pipeline FSDP2: tied rows summed in a copy", "pipeline",
          "dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad",
          "dist.all_reduce(grad.full_tensor() if isinstance(grad, DTensor) else grad", "dp2 pp2 zero2",
          "the tied embedding's copies summed in a gathered copy that is then dropped: each stage keeps its own share"),
    fault("experts x tp: dense gradients summed over tp too", "expert_mesh",
          'if self.d["dp"] > 1:  # every dp rank its own rows (under tp: the dp ranks of this tp index)\n'
          '        _all_reduce_flat([p.grad for p in grads if id(p) not in experts], self.g["data"])',
          'if self.world > 1:\n        _all_reduce_flat([p.grad for p in grads if id(p) not in experts], None)', "tp2 moe",
          "the dense gradients summed over every rank (05m before tp): tp's slices and whole copies added across tp"),
    fault("experts x tp: each expert counted per tp rank", "expert_mesh",
          'return "experts" if id(p) in self.experts and self.ep_group is not None else',
          'return "split" if id(p) in self.experts and self.d["tp"] > 1 else',
          "tp2 moe", "the experts' squares summed over the tp ranks that each hold the same expert whole"),
    fault("cross-layout: AdamW's step count lost", "reshard", '{"step": step.clone(), **t}',
          '{"step": torch.zeros_like(step), **t}', "tp2 to one",
          "a mesh checkpoint's moments saved without their step: the resumed AdamW corrects its bias as at step 1"),
    fault("cross-layout: schedule restarted", "reshard",
          "scheduler.load_state_dict(torch.load(sched, weights_only=True))", "pass", "tp2 to one",
          "DDP reading another layout's checkpoint keeps its fresh schedule: warmup's learning rate from step 0"),
    fault("reshard: data position dropped", "reshard",
          'step = state["step"]; stream.load_state_dict(state["data"])', 'step = state["step"]', "reshard",
          "the run resumed on 1 process reads its epoch from the first batch again"),
    fault("ZeRO-2 bucket: boundary off by one", "zero", "for p in reversed(ps):",
          "for p in reversed(ps[1:]):", "zero2_by_hand",
          "each group's first tensor in no bucket: never reduced, clipped or stepped"),
    fault("ZeRO-2 bucket: reduced twice", "zero", "for p in ps: p.grad = None  # the full gradient goes",
          "for p in ps: pass  # the full gradient stays", "zero2_by_hand",
          "a reduced bucket keeps its gradients: the next micro-batch adds to them, reduced again"),
    fault("ZeRO-2 bucket: slice overwritten", "zero", "self.left[i], self.first[i] = len(ps), False",
          "self.left[i] = len(ps)", "zero2_by_hand",
          "a later micro-batch's reduce-scatter overwrites the slice: the first micro-batch lost"),
    fault("muon: Jordan's scale for Moonshot's", "muon",
          "self.muon = muon(hidden, lr=lr, weight_decay=weight_decay, adjust_lr_fn=adjust_lr_fn)",
          'self.muon = muon(hidden, lr=lr, weight_decay=weight_decay, adjust_lr_fn="original")',
          "dp2 muon", "Muon's updates scaled by √max(1, A/B), not 0.2·√max(A, B): AdamW's learning rate then too small"),
    fault("muon: embeddings orthogonalised", "muon",
          "skip = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}", "skip = set()",
          "dp2 muon", "the token and position embeddings (and the tied head) stepped by Muon, not AdamW"),
    fault("muon: loaded groups left unlinked", "muon", "self.param_groups = self._groups()  # loading",
          "pass  # loading", "muon resume",
          "after a resume the schedule moves the old group dicts: Muon and AdamW keep the saved learning rate"),
    fault("sharded muon: each rank orthogonalises its rows", "muon",
          "if not ps or not isinstance(ps[0], DTensor): return [ns(u) for u in updates]",
          "return [ns(u) for u in updates]", "zero2 muon",
          "ZeRO's naive Muon: Newton-Schulz on each rank's slice of a matrix, not on the whole gathered to its owner"),
    fault("sharded muon: learning rate by the shard's shape", "muon",
          'w.add_(o, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))',
          'w.add_(o, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], w.shape))', "zero2 muon",
          "the update scaled by 0.2·√max(rows here, columns): the MLP's 256 × 64 output at 1/√2 of its rate on 2 ranks"),
    fault("sharded muon: Nesterov's look-ahead dropped", "muon",
          'updates.append(g.lerp(b, mu) if group["nesterov"] else b)', "updates.append(b)", "zero2 muon",
          "the sharded step orthogonalises the momentum itself, not torch's look-ahead g + μ(B − g)"),
    fault("muon: loaded state not split", "muon", 'mine = {k for g in groups[:n] for k in g["params"]}',
          "mine = set()", "zero3 muon resume",
          "a load hands every saved state to AdamW: Muon's momentum (dcp's shards) restarts from zero"),
    fault("fp8 gather: each rank's own amax", "fp8", "dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)",
          "pass", "fp8 gather", "each rank scales its rows by their own amax: the gathered bytes mix scales"),
]
ROWS = []  # (fault, check, verdict, measured): the table printed after the module


def records(out, name="metrics.jsonl", keys=("step", "loss", "grad_norm", "tokens")) -> list:
    "`keys` of each train record of a run's metrics.jsonl (or a worker's `name`)."
    return [{k: r[k] for k in keys} for r in map(json.loads, open(Path(out) / name)) if "split" not in r]


def run_trainer(out, world, flags, repo=ROOT, env=None, resume=False):
    "The trainer on `world` processes of `repo`'s package; None when it ran, else why it did not."
    cmd = [*trainer_cmd(world, TIMEOUT), *ARGS, *flags, "--output_dir", str(out)]
    return _run(cmd + (["--resume", "latest"] if resume else []), repo, env)


def run_worker(module, worker, out, world, repo, env, **kw):
    "`distcourse.<module>.<worker>(out, **kw)` on `world` processes of `repo`'s package; None when it ran, else why."
    code = ("import json, sys; from functools import partial; from distcourse.launch import launch; "
            f"from distcourse.{module} import {worker} as w; launch(partial(w, **json.loads(sys.argv[2])), "
            f"(sys.argv[1],), num_processes={world}, timeout={TIMEOUT})")
    return _run([PY, "-c", code, str(out), json.dumps(kw)], repo, env)


def _run(cmd, repo, env):
    "Run `cmd` in `repo`; None when it exited 0, else the reason (exit code and last stderr line)."
    try: proc = run_cli(cmd, cwd=repo, timeout=TIMEOUT, env=env)  # `repo`: its package imported
    except subprocess.TimeoutExpired: return f"timed out after {TIMEOUT} s"
    if proc.returncode == 0: return None
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    return f"exit {proc.returncode}: {last[:120]}"


def compare(want, got, exact=False, tol=NORM_TOL) -> tuple:  # want, got: lists of train records
    "(equal, what was measured): per-step losses and grad norms of `got` against `want`."
    if [r["step"] for r in got] != [r["step"] for r in want]:
        return "differ", f"steps {[r['step'] for r in got]}, want {[r['step'] for r in want]}"
    loss = max(abs(g["loss"] - w["loss"]) / abs(w["loss"]) for w, g in zip(want, got))
    diffs = [abs(g["grad_norm"] - w["grad_norm"]) / w["grad_norm"] for w, g in zip(want, got)]
    worst = diffs.index(max(diffs))
    ratio = got[worst]["grad_norm"] / want[worst]["grad_norm"]
    what = f"grad_norm ratio {ratio:.6f} (step {got[worst]['step']}), loss rel diff {loss:.1e}"
    if exact: equal, what = got == want, what + (", bit for bit" if got == want else ", not exact")
    else: equal = loss <= max(tol, LOSS_TOL) and max(diffs) <= tol
    return "equal" if equal else "differ", what


def reference(tmp, name) -> Path:
    "One process on the package as it is, flags REFERENCES[name]: what the checks that name it compare with."
    out = tmp / name.replace(" ", "_")
    failed = run_trainer(out, 1, REFERENCES[name])
    assert failed is None, f"the one-process reference {name!r} failed: {failed}"
    return out


def zero2_by_hand(tmp, repo, env) -> tuple:
    "ZeRO-2 by hand (FlatZero2Optimizer) against DDP on the same batches in one run: losses, norms."
    if failed := run_worker("zero", "zero_worker", tmp, 2, repo, env, stages=[0, 2], zero2="flat", steps=3,
                            batch_size=4, seq_len=32, max_examples=200, grad_accum=2): return "failed", failed
    res = json.loads((tmp / "zero.json").read_text())
    want, got = ([{"step": i + 1, "loss": loss, "grad_norm": norm}
                  for i, (loss, norm) in enumerate(zip(res[s]["losses"], res[s]["grad_norms"]))]
                 for s in ("0", "2"))
    return compare(want, got)


def sp2(tmp, repo, env) -> tuple:
    "Sequence parallelism at tp 2 (lesson 05d's worker) against one process in the same run: losses, norms."
    if failed := run_worker("sequence_parallel", "sp_worker", tmp, 2, repo, env, tp=2, steps=3):
        return "failed", failed
    res = json.loads((tmp / "sp.json").read_text())
    want, got = ([{"step": i + 1, "loss": loss, "grad_norm": norm}
                  for i, (loss, norm) in enumerate(zip(res["losses"][k], res["norms"][k]))]
                 for k in ("one process", "tp+sp"))
    return compare(want, got)


def fp8_gather(tmp, repo, env) -> tuple:
    "The float8 all-gather (lesson 04c's worker) on 2 processes: one process's FP8 bytes, half bf16's payload."
    if failed := run_worker("fp8", "fp8_gather_worker", tmp, 2, repo, env): return "failed", failed
    r = json.loads((tmp / "fp8_gather.json").read_text())
    half = 2 * r["fp8_bytes"]["all_gather_into_tensor"] == r["bf16_bytes"]["all_gather_into_tensor"]
    return "equal" if r["equal"] and half else "differ", f"bytes as one process's: {r['equal']}, half of bf16's: {half}"


def reshard(tmp, repo, env) -> tuple:
    "A straight run on 2 processes x 4, its step-1 checkpoint resumed by 1 process x 8: steps 2-3 as straight."
    kw = dict(max_steps=3, save_every=1, max_examples=80)  # the global batch: 8 in both
    if failed := run_worker("reshard", "reshard_worker", tmp / "two", 2, repo, env, batch_size=4, **kw):
        return "failed", failed
    shutil.copytree(tmp / "two/checkpoints/step_1", tmp / "one/checkpoints/step_1")
    if failed := run_worker("reshard", "reshard_worker", tmp / "one", 1, repo, env, batch_size=8, **kw):
        return "failed", failed
    straight, resumed = (records(tmp / d, "steps.jsonl", ("step", "loss", "grad_norm")) for d in ("two", "one"))
    return compare(straight[1:], resumed)  # another world size: the same sums in another order, not bit for bit


def cut_to_step_1(run, again):
    "A copy of the output directory `run` at `again`, without its checkpoints after step 1."
    shutil.copytree(run, again)
    for later in (again / "checkpoints").glob("step_*"):  # all but step 1's
        if later.name != "step_1": shutil.rmtree(later)


def resume(tmp, repo, env, reference, flags=REFERENCES["one"]) -> tuple:  # flags: the reference's
    "The reference without its checkpoints after step 1, resumed: steps 2-3 (or 2-4) repeat exactly."
    cut_to_step_1(reference, tmp / "again")
    if failed := run_trainer(tmp / "again", 1, flags, repo, env, resume=True): return "failed", failed
    return compare(records(reference), records(tmp / "again"), exact=True)


def zero3_muon_resume(tmp, repo, env) -> tuple:
    "Muon under ZeRO-3 on 2 processes, its step-1 checkpoint (dcp's shards) resumed on 2: steps 2-4 bit for bit."
    flags = ["--zero_stage", "3", *MUON, *HALF, "--save_every", "1", "--keep_checkpoints", "4"]
    if failed := run_trainer(tmp / "straight", 2, flags, repo, env): return "failed", failed
    cut_to_step_1(tmp / "straight", tmp / "again")
    if failed := run_trainer(tmp / "again", 2, flags, repo, env, resume=True): return "failed", failed
    return compare(records(tmp / "straight"), records(tmp / "again"), exact=True)


def tp2_to_one(tmp, repo, env, reference) -> tuple:
    "tp 2 saving every step, its step-1 checkpoint resumed by one process: steps 2-3 as the reference's."
    source, again = tmp / "tp2", tmp / "one"
    if failed := run_trainer(source, 2, ["--tp", "2", *REFERENCES["one"]], repo, env): return "failed", failed
    flags = [*WHOLE, "--resume", str(source / "checkpoints/step_1")]  # another layout: dcp's whole tensors
    if failed := run_trainer(again, 1, flags, repo, env): return "failed", failed
    verdict, what = compare(records(reference)[1:], records(again))  # another layout's step 1: not bit for bit
    lrs = [[r["lr"] for r in records(d, keys=("lr",))] for d in (reference, again)]  # after each step: the schedule
    if lrs[1] != lrs[0][1:]: return "differ", f"{what}; learning rates {lrs[1]}, want {lrs[0][1:]}"
    return verdict, what


WORKERS = {"zero2_by_hand": zero2_by_hand, "sp2": sp2, "reshard": reshard,  # each runs its own reference
           "zero3 muon resume": zero3_muon_resume, "fp8 gather": fp8_gather}
# each resumes a checkpoint of its reference: (the check, the reference's name)
RESUMES = {"resume": (resume, "one"), "tp2 to one": (tp2_to_one, "one"),
           "muon resume": (partial(resume, flags=REFERENCES["one muon"]), "one muon")}
CHECKS = [*LAYOUTS, *WORKERS, *RESUMES]


def reference_of(check) -> str:
    "The name of the one-process reference `check` compares with; None for a worker, which runs its own."
    return None if check in WORKERS else RESUMES[check][1] if check in RESUMES else LAYOUTS[check][2]


def run_check(name, tmp, refs, repo=ROOT, env=None) -> tuple:  # refs: {reference name: future of its output}
    "('equal' | 'differ' | 'failed' (the run did not finish), what was measured) for check `name`."
    if name in WORKERS: return WORKERS[name](tmp, repo, env)
    want = refs[reference_of(name)]
    if name in RESUMES: return RESUMES[name][0](tmp, repo, env, want.result())
    world, flags, _ = LAYOUTS[name]
    out = tmp / name.replace(" ", "_")
    if failed := run_trainer(out, world, flags, repo, env): return "failed", failed
    return compare(records(want.result()), records(out), tol=TOLERANCES.get(name, NORM_TOL))


@pytest.fixture(scope="module", autouse=True)
def table(request):
    "After the module: every fault, the check that ran on it and what it measured."
    yield
    width = max((len(row[0]) for row in ROWS), default=0)
    print_table(request, ["fault (module) -> check -> verdict: measured"] * bool(ROWS)
                + ["{:{w}} -> {:15} -> {}: {}".format(*row, w=width) for row in ROWS])


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    """The selected checks on the package as it is and with each selected fault, two runs at a time (a run is
    mostly imports and process starts, one core each): {("check" | "fault", name): (verdict, what)}. The
    references the selected checks need are queued first, so a check waiting for one never waits for a queued
    run; `resume` checks go last, as they copy their reference before running anything."""
    items = [i for i in request.session.items if i.module is request.module and hasattr(i, "callspec")]
    jobs = [("check", i.callspec.params["name"], None) for i in items
            if i.originalname == "test_check_passes_unmutated"]
    jobs += [("fault", i.callspec.params["f"]["name"], i.callspec.params["f"]) for i in items
             if i.originalname == "test_fault_is_caught"]
    def check(job): return job[1] if job[2] is None else job[2]["check"]
    jobs.sort(key=lambda job: check(job) in ("resume", "muon resume"))  # stable: otherwise in the order pytest selected them
    needed = sorted({reference_of(check(job)) for job in jobs} - {None})
    refs_dir = tmp_path_factory.mktemp("references")
    def one(kind, name, f, refs):
        tmp = tmp_path_factory.mktemp("check")
        try:
            if f is None: return run_check(name, tmp, refs)
            repo = fresh_copy(tmp / "repo")
            mutate(repo, f)
            return run_check(f["check"], tmp, refs, repo, copy_env(repo))
        except Exception as e: return "error", e  # raised by its own test (a failed reference too)
    with ThreadPoolExecutor(2) as pool:  # first in, first started: the references before any check
        refs = {name: pool.submit(reference, refs_dir, name) for name in needed}
        futures = {(kind, name): pool.submit(one, kind, name, f, refs) for kind, name, f in jobs}
        return {key: future.result() for key, future in futures.items()}


def outcome(outcomes, key) -> tuple:
    verdict, what = outcomes[key]
    if verdict == "error": raise what
    return verdict, what


FAST = {"dp2", "tp2", "resume", "zero2 muon", "dp: mean where sum", "tp: sum where mean",
        "resume data off by one"}  # the fast tier


def tiered(values, ids):
    "Parameters, those named in FAST marked for the fast tier."
    return [pytest.param(v, id=i, marks=[pytest.mark.fast] if i in FAST else []) for v, i in zip(values, ids)]


@pytest.mark.parametrize("name", tiered(CHECKS, CHECKS))
def test_check_passes_unmutated(name, outcomes):
    "A check that always failed would prove nothing: on the package as it is, each one passes."
    verdict, what = outcome(outcomes, ("check", name))
    ROWS.append(("(none)", name, "passes" if verdict == "equal" else f"FAILS ({verdict})", what))
    assert verdict == "equal", f"{name} fails on the unmutated package: {what}"


def mutated(text, f) -> str:  # text: distcourse/<module>.py as it is; f: one of FAULTS
    "`text` with fault `f` written in; its `old` text must occur once."
    found = text.count(f["old"])
    assert found == 1, (f"fault {f['name']!r}: its text occurs {found} times in "
                        f"distcourse/{f['module']}.py, not once: the code changed, so update this "
                        f"fault in tests/test_mutation.py (old: {f['old']!r})")
    text = text.replace(f["old"], f["new"])
    compile(text, f"distcourse/{f['module']}.py", "exec")  # a fault is wrong arithmetic, never a syntax error
    return text


def mutate(repo, f):  # f: one of FAULTS
    "Write fault `f` into `repo`'s copy of distcourse/<module>.py."
    path = repo / "distcourse" / f"{f['module']}.py"
    path.write_text(mutated(path.read_text(), f))


@pytest.mark.fast
@pytest.mark.parametrize("f", FAULTS, ids=[f["name"] for f in FAULTS])
def test_fault_still_applies(f):
    "Without a run: every fault's text is still in the package once, and its check exists (the full tier runs it)."
    assert f["check"] in CHECKS, f"fault {f['name']!r}: no check {f['check']!r}; choose one of {CHECKS}"
    assert f["new"] != f["old"]
    mutated((ROOT / "distcourse" / f"{f['module']}.py").read_text(), f)


@pytest.mark.parametrize("f", tiered(FAULTS, [f["name"] for f in FAULTS]))
def test_fault_is_caught(f, outcomes):
    "The fault, written into a fresh copy of the package, makes its check's numbers differ."
    verdict, what = outcome(outcomes, ("fault", f["name"]))
    shown = {"differ": "caught", "equal": "NOT CAUGHT", "failed": "RUN FAILED"}[verdict]
    ROWS.append((f"{f['name']} ({f['module']}.py)", f["check"], shown, what))
    # A fault is wrong arithmetic: a crash or a hang would prove nothing about the comparison.
    assert verdict != "failed", (f"fault {f['name']!r} made the run fail ({what}) instead of "
                                 "changing its numbers: update it in tests/test_mutation.py")
    assert verdict == "differ", f"{f['name']!r} ({f['what']}) not caught by {f['check']}: {what}"
