"""Dropout under tensor parallelism on 2 real processes (gloo), through the trainer's `Mesh`: the split heads draw
independent masks (the RNG tracker), every replicated dropout draws the same mask on both ranks, the training loss
over seeds has one process's distribution, and recomputation replays the tracked masks. Each check is also run on
a planted fault and must reject it: the shared-mask bug (every rank's heads on the default generator), the
attention dropout left out, recomputation without the tracker's replay."""
import json
import math
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distcourse.launch import launch
from distcourse.gpt import load_into_hf, to_gpt
from distcourse.mesh import Mesh
from distcourse.recompute import RNGTracker, checkpoint_blocks, tp_seed
from distcourse.tensor_parallel import is_split

P = 0.1        # GPT-2's dropout, which --model base trains with
SEEDS = 200    # training-mode losses for the loss statistics (50 for the planted fault: z ≈ -14 there)
Z_MAX = 4.5    # |z| a statistic may reach under the null: 6.8e-6 false failures per check (two-sided normal)
# Measured 2026-11-25 (200 seeds): the shared-mask bug moves neither the mean loss (z = -0.31) nor its variance
# (ratio 0.92), so the loss statistics cannot see it; the mask check does (z = 61). With the tracker, 1,500 seeds:
# z = -0.93 for the mean, variance ratio 1.08.


def fitted_gpt2(ids, targets):
    "A small GPT-2 with dropout P, fitted (dropout off) to one batch so that dropout moves its loss."
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=8,
                                    resid_pdrop=P, embd_pdrop=P, attn_pdrop=P, initializer_range=0.2))
    gpt = to_gpt(hf).eval()  # no dropout while fitting
    opt = torch.optim.Adam(gpt.parameters(), lr=1e-2)
    for _ in range(40):
        gpt(ids, targets)[1].backward()
        opt.step()
        opt.zero_grad()
    load_into_hf(hf, {k: p.detach() for k, p in gpt.named_parameters()})
    for p in hf.parameters(): dist.broadcast(p.data, 0)  # bit-equal on every rank
    return hf


def recording_sdpa(log):
    "SDPA whose dropout mask SDPA itself draws from the active generator; noted in `log`, then applied."
    real = F.scaled_dot_product_attention
    def sdpa(q, k, v, dropout_p=0.0, is_causal=False, **kw):
        B, h, T, d = q.shape
        eye = torch.eye(T, device=q.device).expand(B, h, T, T)  # v = I: the output is the dropped weights
        dropped = real(torch.zeros_like(q), torch.zeros_like(k), eye, dropout_p=dropout_p, is_causal=True)
        kept = dropped > 0  # (B, h, T, T): the uniform causal weights 1/(t+1), zero where dropped
        log.append(kept)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        att = (q @ k.transpose(-2, -1) / math.sqrt(d)).masked_fill(~causal, float("-inf")).softmax(-1)
        return (att * kept / (1 - dropout_p)) @ v  # (B, h, T, d): the attention, with that mask
    return sdpa


def gathered(t):
    "`t` from every rank, in rank order."
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def masks(mesh, x, y, rank) -> dict:
    "One training forward: every rank's attention masks (L, B, H/2, T, T); replicated masks equal on all?"
    attn, whole = [], []
    hooks = [m.register_forward_hook(lambda m, i, o: whole.append(o != 0))
             for m in mesh.model.modules() if isinstance(m, nn.Dropout)]  # embedding, resid, MLP: replicated
    real, F.scaled_dot_product_attention = F.scaled_dot_product_attention, recording_sdpa(attn)
    try:
        torch.manual_seed(7)  # the default generator alike on every rank, as the trainer's set_seed leaves it
        mesh.rng.add("tp", tp_seed(0, rank, 1))  # as Mesh.train_steps seeds step 1
        with torch.no_grad(): mesh._forward(x, y)
    finally:
        F.scaled_dot_product_attention = real
        for h in hooks: h.remove()
    same = all(torch.equal(*gathered(m)) for m in whole)
    return {"attn": [m.tolist() for m in gathered(torch.stack(attn))], "replicated_equal": same,
            "replicated": len(whole)}


def losses(mesh, one, x, y, rank, seeds=SEEDS) -> list:
    "(tp, one process) per-token training-mode loss at the same weights, for each seed."
    n, out = (y != -100).sum(), []
    with torch.no_grad():
        for s in range(seeds):
            torch.manual_seed(s)
            mesh.rng.add("tp", tp_seed(s, rank, 1))
            tp = (mesh._forward(x, y) / n).item()
            torch.manual_seed(10_000 + s)  # other masks: the two samples independent
            out.append((tp, one(x, y)[1].item()))
    return out


def recompute_diffs(mesh, x, y, rank) -> dict:
    "Largest gradient difference of the tp model with vs without checkpoint_blocks, same seeds, and unreplayed."
    def grads():
        torch.manual_seed(3)
        mesh.rng.add("tp", tp_seed(0, rank, 1))
        mesh.model.zero_grad(set_to_none=True)
        mesh._forward(x, y).backward()
        return [p.grad.clone() for p in mesh.model.parameters()]
    def worst(a, b): return max((g - h).abs().max().item() for g, h in zip(a, b))
    plain = grads()
    checkpoint_blocks(mesh.model)
    res = {"replayed": worst(plain, grads())}
    replay = RNGTracker.replay
    RNGTracker.replay = lambda self: nullcontext()  # planted: the tracked state is not replayed
    res["not replayed"] = worst(plain, grads())
    RNGTracker.replay = replay
    checkpoint_blocks(mesh.model, enabled=False)
    return res


def in_sync_after_steps(hf, cfg, batch, rank, apart=False) -> bool:
    "3 of the Mesh's training steps with dropout: are the replicated parameters still equal on both ranks?"
    mesh = Mesh(hf, cfg)
    torch.manual_seed(11 + (rank if apart else 0))  # apart (planted): the ranks' default generators differ
    for _ in mesh.train_steps(iter([batch] * 3), 3): pass
    whole = [p.detach() for n, p in mesh.model.named_parameters() if not is_split(mesh.model, n)]
    return all(torch.equal(*gathered(p)) for p in whole)


def resumed_masks(hf, cfg, batch) -> dict:
    "The attention masks of Mesh.train_steps' step 2, run from the start and resumed after step 1."
    got = {}
    for start in (0, 1):
        mesh, log = Mesh(hf, cfg), []
        real, F.scaled_dot_product_attention = F.scaled_dot_product_attention, recording_sdpa(log)
        try:
            for step, _ in mesh.train_steps(iter([batch] * 2), 2, start):
                got[f"step {step}, start {start}"] = torch.stack(log)
                log.clear()  # what the next step draws
        finally: F.scaled_dot_product_attention = real
    return {"resumed equal": torch.equal(got["step 2, start 0"], got["step 2, start 1"]),
            "steps differ": not torch.equal(got["step 1, start 0"], got["step 2, start 0"])}


def worker(out_dir):
    "Each rank: masks, losses over seeds and recomputation, correct and with each planted fault."
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ids = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1))  # CPU on purpose: data
    hf = fitted_gpt2(ids, F.pad(ids[:, 1:], (0, 1), value=-100))
    cfg = SimpleNamespace(tp=2, pp=1, cp=1, pp_schedule="1f1b", lr=1e-3, weight_decay=0.1, warmup_steps=1,
                          max_steps=10, seed=0)
    mesh, one = Mesh(hf, cfg), to_gpt(hf).train()
    x, y = mesh.rows({"input_ids": ids, "labels": ids})
    res = {"tracker": masks(mesh, x, y, rank), "losses": losses(mesh, one, x, y, rank)}
    fork = RNGTracker.fork
    RNGTracker.fork = lambda *a: nullcontext()  # planted: the shared-mask bug, every head on the default RNG
    res["shared"] = masks(mesh, x, y, rank)
    RNGTracker.fork = fork
    for b in mesh.model.transformer.h: b.attn.dropout = 0.0  # planted: no attention dropout under tp
    res["losses, attention dropout off"] = losses(mesh, one, x, y, rank, 50)
    for b in mesh.model.transformer.h: b.attn.dropout = P
    res["recompute"] = recompute_diffs(mesh, x, y, rank)
    batch = {"input_ids": ids, "labels": ids}
    res["in sync"] = [in_sync_after_steps(hf, cfg, batch, rank, apart) for apart in (False, True)]
    res["resume"] = resumed_masks(hf, cfg, batch)
    if rank == 0: Path(out_dir, "res.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_dropout")
    launch(worker, (out,), num_processes=2, timeout=180)
    return json.loads((out / "res.json").read_text())


def independence_z(attn, p=P) -> float:
    "z of the agreement of rank 0's and rank 1's masks, same local head, if they were independent."
    a, b = (torch.tensor(m) for m in attn)  # (L, B, H/2, T, T) each: global heads h and h + H/2
    low = torch.ones(a.shape[-1], a.shape[-1], dtype=torch.bool).tril()  # causal: the drawn entries
    agree, q = (a == b)[..., low].float(), p * p + (1 - p) ** 2  # independent: both kept or both dropped
    return (agree.mean().item() - q) / math.sqrt(q * (1 - q) / agree.numel())


def keep_z(attn, p=P) -> float:
    "z of rank 0's kept fraction against 1 - p."
    a = torch.tensor(attn[0])
    kept = a[..., torch.ones(a.shape[-1], a.shape[-1], dtype=torch.bool).tril()].float()
    return (kept.mean().item() - (1 - p)) / math.sqrt(p * (1 - p) / kept.numel())


def loss_z(pairs) -> float:
    "z of (mean tp loss - mean one-process loss) over the seeds (Welch; independent samples)."
    tp, one = torch.tensor(pairs, dtype=torch.float64).T
    return ((tp.mean() - one.mean()) / (tp.var() / len(tp) + one.var() / len(one)).sqrt()).item()


def test_split_heads_draw_independent_masks(res):
    "Heads h and h + H/2 (rank 0's and rank 1's local head h) agree as often as independent masks do."
    r = res["tracker"]
    assert abs(independence_z(r["attn"])) < Z_MAX, independence_z(r["attn"])
    assert abs(keep_z(r["attn"])) < Z_MAX, keep_z(r["attn"])  # and they drop p of the weights


def test_replicated_dropouts_draw_the_same_mask(res):
    "Embedding, attention-residual and MLP dropout act on whole activations: one mask, on both ranks."
    assert res["tracker"]["replicated"] == 1 + 2 * 2  # embedding + 2 per block, 2 blocks
    assert res["tracker"]["replicated_equal"] and res["shared"]["replicated_equal"]


def test_replicated_weights_stay_equal_while_training(res):
    """3 steps of Mesh.train_steps with dropout keep the replicated weights bit-equal on both tp ranks; ranks
    whose default generators differ (planted) drift apart at once."""
    assert res["in sync"] == [True, False]


def test_resumed_run_draws_the_same_masks(res):
    "The tracked state is seeded per step: step 2 resumed after step 1 draws step 2's masks, not step 1's again."
    assert res["resume"] == {"resumed equal": True, "steps differ": True}


def test_shared_mask_bug_is_caught(res):
    "Planted: without the tracker every rank draws its heads' masks alike; the same check rejects it."
    z = independence_z(res["shared"]["attn"])
    assert z > Z_MAX, z  # measured ~61: every entry agrees


def test_loss_over_seeds_matches_one_process(res):
    "Over the seeds, tp's mean training loss is one process's (other masks, the same law)."
    z = loss_z(res["losses"])
    assert abs(z) < Z_MAX, z
    z_off = loss_z(res["losses, attention dropout off"])  # planted: tp drops no attention weights
    assert abs(z_off) > Z_MAX, z_off


def test_recompute_replays_the_tracked_masks(res):
    "checkpoint_blocks on the tp model: the gradients of one process's masks; without the replay, others."
    assert res["recompute"]["replayed"] <= 1e-6, res["recompute"]  # the same ops on the same masks
    assert res["recompute"]["not replayed"] > 1e-3, res["recompute"]
