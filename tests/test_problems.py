"""The parallelism lessons' problem sets ("predict, then the cell measures"), checked against the planner's own
functions (lessons 09b, 09bb, 09c): the answer each `Problem k` cell hands `check_prediction` (its cells run here as
a learner runs them) equals the planner's, and plausible wrong answers are refused by `check_prediction`, as a
learner's would be."""
import json
import re
from dataclasses import replace
from functools import lru_cache
from unittest.mock import patch

import pytest

from conftest import ROOT
from distcourse.comm import bus_factor
from distcourse.gpu_costs import attention_s, block_matmuls, matmul_s
from distcourse.machine import PROFILES, Profile, collective_s
import distcourse.memory as memory_module
from distcourse.memory import check_prediction
from distcourse.planner import Layout, bubble, dp_messages, held, layouts, memory, rank_params, step_time
from distcourse.sizes import Shape, block_params, flops_token, n_params

pytestmark = pytest.mark.fast  # the problem cells are arithmetic on the lessons' functions: seconds

GPT2 = Shape(name="gpt2-small", n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
PSI = 124_439_808  # GPT-2 small's parameters, as the problems state them


def state(L, dtype="fp32") -> float:
    "Bytes of model state a rank holds in the planner's memory model (params, gradients, optimizer)."
    m = memory(GPT2, L, 1024, dtype)
    return m["params"] + m["grads"] + m["optimizer"]


def sent(L) -> float:
    "Bytes one rank sends in a step's data-parallel messages (the planner's dp_messages), ring collectives."
    return sum(b * k * bus_factor(name, n) for name, b, n, k in dp_messages(GPT2, L, 4 * PSI))


def first(ok) -> int:
    return next(n for n in range(1, 10_000) if ok(n))


NIC = Profile("one NIC per GPU", 8, 1e15, 1.0, 80e9, (0.0, 50e9), (0.0, 50e9))  # 50 GB/s, latency left out
# lesson -> {problem: (the planner's answer, plausible wrong answers)}
PROBLEMS = {
    "05_memory": {
        1: (lambda: state(Layout(dp=8)), [12 * PSI, 16 * PSI / 8, 8 * PSI]),  # no grads; ZeRO-3's; bf16's
        2: (lambda: state(Layout(dp=8, zero_stage=2), "bf16"), [16 * PSI / 8, 5.5 * PSI, 16 * PSI]),  # z3, z1, DDP
        3: (lambda: first(lambda n: state(Layout(dp=n, zero_stage=1), "bf16") <= 0.75 * 2**30), [4, 8, 3])},
    "05a_zero": {
        1: (lambda: sent(Layout(dp=8, zero_stage=1)), [2 * 7 / 8 * 4 * PSI, 3 * 4 * PSI, 7 / 8 * 4 * PSI]),
        2: (lambda: sent(Layout(dp=8, zero_stage=3, grad_accum=4)),  # once a step; forward only; one reduction
            [3 * 7 / 8 * 4 * PSI, 2 * 4 * 7 / 8 * 4 * PSI, 9 * 7 / 8 * 4 * PSI]),
        3: (lambda: first(lambda n: n > 1 and collective_s(NIC, "all_reduce", 4 * PSI, n) > 2.0 / n),
            [101, 203, 100])},  # n - 1 for (n - 1)/n; one pass of the ring (or bf16's bytes); N - 1
    "05e_pipeline": {
        1: (lambda: bubble("1f1b", 4, 12), [3 / 12, 4 / 16, 3 / 16]),  # over busy time; p for p - 1; one slot more
        2: (lambda: held("1f1b", 4, 16, stage=1), [4, 16, 2]),  # stage 0's; GPipe's; p - stage - 1
        3: (lambda: 8 * 0.030 / (1 - bubble("1f1b", 4, 8)), [0.24, 0.36, 0.27])},  # no bubble; a slot more; fwd
}


# 05aa_muon: what Muon takes (09ba's block_params), its state under DDP (09c's memory), Newton-Schulz on an H100
# (09bb's matmul_s, h100-node); the planner has no Muon model, so the hidden matrices are counted from its sizes


def muon_hidden(s) -> int:
    "Parameters Muon takes: each block's q/k/v, attention-out and two MLP matrices (12 C²), no biases, no tables."
    C, blk = s.n_embd, block_params(s)
    return s.n_layer * (blk["split"] - 3 * C + blk["mlp"] - 4 * C)  # c_attn's and c_fc's biases split off


def muon_ns_block_s(s, p, steps=5) -> float:
    "Seconds of one block's Newton-Schulz matmuls: X (m x n) wide, X Xᵀ, A·A, B·X per iteration, bf16."
    C = s.n_embd
    shapes = [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)]  # transformers' Conv1D: (in, out)
    return sum(steps * (matmul_s(p, m, m, n) + matmul_s(p, m, m, m) + matmul_s(p, m, n, m))
               for m, n in map(sorted, shapes))  # a tall matrix transposed


PROBLEMS["05aa_muon"] = {
    1: (lambda: muon_hidden(GPT2), [124_318_464,  # every 2-D weight: the embeddings counted too
                                    85_017_600,  # the biases counted with their matrices
                                    49_545_216,  # c_attn and c_fc alone: the output projections forgotten
                                    39_505_152]),  # AdamW's share, not Muon's
    2: (lambda: memory(GPT2, Layout(dp=8), 1024, "fp32")["optimizer"] - 4 * muon_hidden(GPT2),
        [8 * PSI,  # AdamW's: Muon given two moments
         4 * PSI,  # one number a parameter everywhere: AdamW's second moment forgotten
         8 * 39_505_152,  # Muon's momentum forgotten
         (8 * PSI - 4 * 84_934_656) / 8]),  # divided by the 8 GPUs: ZeRO's sharding, not DDP's
    3: (lambda: muon_ns_block_s(GPT2, PROFILES["h100-node"]),
        [702.018e-6,  # the tall MLP c_proj not transposed: a 3072 x 3072 Gram matrix
         146.508e-6,  # A·A dropped: a cubic, two matmuls an iteration
         219.762e-6,  # A·(A·X) formed instead of (A·A)·X
         128.195e-6]),  # the datasheet's full 989.4 TFLOP/s: the 75% forgotten
}



# 05b_recompute: the planner's activations (09c's memory), GPT-2 small as the trainer runs it on dp alone


def recompute_kept(seqs=1, ac=False) -> float:
    "The planner's bytes kept for backward (blocks and final norm) by GPT-2 small, `seqs` x 1024 tokens, fp32."
    return memory(GPT2, Layout(batch_size=seqs, activation_checkpointing=ac), 1024, "fp32")["activations"]


PROBLEMS["05b_recompute"] = {
    1: (lambda: recompute_kept(), [611_065_856,  # the course's GPT: transformers' Python GELU left out
                                   762_060_800,  # one GELU tensor a block, not three
                                   12 * 2 * 786_432 * (34 + 80)]),  # the paper's count doubled (s x s kept)
    2: (lambda: recompute_kept(ac=True), [44_048_384,  # the inputs only: the recomputed block forgotten
                                          94_445_568,  # the course's block recomputed, no Python GELU
                                          1_064_050_688]),  # no saving: every activation kept
    3: (lambda: first(lambda n: recompute_kept(n, True) > 10 * 2**30) - 1,
        [10,    # without recomputation
         243,   # the recomputed block forgotten
         82]),  # rounded up: over the budget
}


# 05c_tensor_parallel: a rank's parameters and state (09c's rank_params, memory), tp's all-reduces (step_time)

PROBLEMS["05c_tensor_parallel"] = {
    1: (lambda: state(Layout(tp=2)), [16 * PSI / 2,  # everything split, the embeddings too
                                      16 * PSI,  # nothing split: one process's
                                      12 * rank_params(GPT2, Layout(tp=2))]),  # the gradients forgotten
    2: (lambda: first(lambda n: state(Layout(tp=n), "bf16") <= 2**30),
        [2,    # everything split: 16 PSI / t
         3,    # t >= 3.07 rounded down
         6]),  # the next degree after 4
    3: (lambda: step_time(GPT2, Layout(tp=8), 1024, PROFILES["h100-node"])["tp"],
        [48 * 1.75 * 1_572_864 / 450e9,  # the latency left out
         24 * (14 * 5e-6 + 1.75 * 1_572_864 / 450e9),  # the forward's two all-reduces only
         48 * (7 * 5e-6 + 1.75 * 1_572_864 / 450e9)]),  # N - 1 latency steps, not 2(N - 1)
}


# 05d_sequence_parallel: one block's activations per rank (09c's memory; norms cut by tp only when megatron)


def sequence_parallel_block(L, megatron=False) -> float:
    "The planner's bytes one block keeps per rank: its activations at 2 blocks less at 1 (the final norm cancels)."
    s = replace(GPT2, megatron=megatron)
    return (memory(replace(s, n_layer=2), L, 1024)["activations"]
            - memory(replace(s, n_layer=1), L, 1024)["activations"])


PROBLEMS["05d_sequence_parallel"] = {
    1: (lambda: sequence_parallel_block(Layout(tp=4)), [12_599_296,  # SP's: the LayerNorms' tensors cut too
                                                        50_397_184,  # one process's
                                                        17_317_888]),  # the norms cut, the gathered inputs whole
    2: (lambda: first(lambda n: 12 * sequence_parallel_block(Layout(tp=4, batch_size=n), True) > 2**30) - 1,
        [4,    # TP alone: the norms' tensors whole
         8,    # rounded up: over the budget
         1]),  # one process
    3: (lambda: sum(b * k * bus_factor(name, n) for name, b, n, k in
                    dp_messages(GPT2, Layout(dp=4, tp=2), 4 * rank_params(GPT2, Layout(dp=4, tp=2)))),
        [1.5 * 4 * PSI,  # the whole model's gradients
         2 * 4 * 81_940_224,  # the (N - 1)/N dropped
         1.75 * 4 * 81_940_224]),  # an all-reduce over all 8 ranks
}


# 05da_async_tp: a step's matmul against its chunk's transfer (09bb's matmul_s, 09b's collective_s, h100-node)


def async_tp_step(tp, tokens=8192, width=8192) -> tuple:
    "(one ring step's matmul, one chunk's transfer) in seconds: a column-parallel 4C layer, bf16, an H100 node."
    p = PROFILES["h100-node"]
    return (matmul_s(p, tokens // tp, 4 * width // tp, width),
            collective_s(p, "all_gather", 2 * tokens * width, tp) / (tp - 1))  # tp - 1 steps of one chunk


PROBLEMS["05da_async_tp"] = {
    1: (lambda: collective_s(PROFILES["h100-node"], "all_gather", 2 * 8192**2, 8)
        + matmul_s(PROFILES["h100-node"], 8192, 4096, 8192),
        [0.74086e-3,   # the matmul alone: the gather assumed hidden
         0.29598e-3,   # the all-gather alone
         1.00184e-3]),  # the latency left out
    2: (lambda: 7 * max(*async_tp_step(8)) + async_tp_step(8)[0],
        [1.03684e-3,   # the plain layer's: no overlap
         0.38859e-3,   # the transfers and the last matmul: the matmuls taken as free
         0.64830e-3]),  # tp - 1 matmuls: the last step's forgotten
    3: (lambda: next(t for t in (2, 4, 8, 16, 32, 64) if async_tp_step(t)[1] > async_tp_step(t)[0]),
        [32,   # the latency left out
         8,    # the lesson's tp, where the matmul still hides the transfer
         64]),
}


# 05f_schedules: interleaved 1F1B, the planner's closed forms (09c's bubble and held)
PROBLEMS["05f_schedules"] = {
    1: (lambda: bubble("interleaved", 4, 8, v=4),
        [3 / 19, 3 / 32, 3 / 11]),  # v = 2's share; the ratio to busy time, not the step's share; 1F1B's
    2: (lambda: held("interleaved", 8, 16, stage=0, v=2),
        [23, 8, 11]),  # chunks counted whole; 1F1B's p on rank 0; the warm-up's 22 chunks, steady state forgotten
    3: (lambda: 16 * 0.030 / (1 - bubble("interleaved", 8, 16, v=2)),
        [0.48, 0.69, 0.6])}  # no bubble; 1F1B's (m + p - 1) slots; p for p - 1 fill-and-drain chunk slots


# 05g_context_parallel: activations per rank (09c's memory with Layout(cp=...)), the ring's K/V hops
# (09b's collective_s, send_recv), a rank's share of attention work (09bb's attention_s)

CP_ACTS = memory(GPT2, Layout(cp=4), 8192)["activations"]  # fp32, one sequence of 8192 tokens on 4 ranks
CP_KV = 2 * 2 * (32768 // 8) * 768  # bf16 K and V of a rank's T/cp tokens: one ring hop's message
PROBLEMS["05g_context_parallel"] = {
    1: (lambda: memory(GPT2, Layout(cp=4), 8192)["activations"],
        [4 * CP_ACTS,  # cp forgotten: the whole sequence on every rank
         CP_ACTS / 2,  # 2 bytes a number (bf16's), not fp32's 4
         12 * 16 * 4 * 2048 * 768]),  # the C-wide tensors only: no means, 1/stds, log-sum-exps, final norm
    2: (lambda: 12 * (8 - 1) * collective_s(NIC, "send_recv", CP_KV, 8),
        [12 * 8 * CP_KV / 50e9,  # cp hops, not cp - 1 (a rank's own block needs none)
         12 * 7 * CP_KV / 2 / 50e9,  # K without V
         12 * 7 * CP_KV * 2 / 50e9]),  # fp32's 4 bytes
    3: (lambda: attention_s(GPT2, PROFILES["h100-node"], 1, 8192 // 8, 8192)
                / attention_s(GPT2, PROFILES["h100-node"], 1, 8192, 8192),
        [15 / 64,  # the contiguous split's last rank, (2p - 1)/p²
         1 / 16,  # the rank's 2 chunks of 2p, not its work
         17 / 256])}  # its 2p + 1 blocks over the whole (2p)² square, masked blocks included


# 05h_ring_memory: what a rank keeps with the lean ring, as the planner counts activations under cp
# (09c's memory with Layout(cp=...): attention keeps q, k, v, out and a log-sum-exp, O(T/cp))


def ringmem_block(cp, T):
    "Bytes one block keeps on a rank in the planner: a 2-block model's activations less a 1-block model's."
    one, two = (memory(replace(GPT2, n_layer=n), Layout(cp=cp), T)["activations"] for n in (1, 2))
    return two - one


def ringmem_fits(cp, T, budget):
    "The planner's activations of GPT-2 small's 12 blocks and final norm on a rank, within `budget` bytes."
    return memory(GPT2, Layout(cp=cp), T)["activations"] <= budget


RINGMEM_LEAN = 12 * (8192 // 4) * (4 * 64 + 1) * 4  # the lean ring's q, k, v, out and lse, one block
PROBLEMS["05h_ring_memory"] = {
    1: (lambda: ringmem_block(4, 8192),
        [RINGMEM_LEAN,  # attention's tensors alone, the block's norms and MLP forgotten
         4 * ringmem_block(4, 8192),  # cp forgotten: the whole sequence's tokens
         RINGMEM_LEAN + (12 * 768 * 4 + 16) * 8192]),  # the position-wise rest counted for all T tokens
    2: (lambda: next(cp for cp in (1, 2, 4, 8, 16, 32, 64) if ringmem_fits(cp, 131072, 16 * 2**30)),
        [4, 2, 16]),  # 4.55 rounded down; attention's tensors alone (18.1 GiB over cp); one power too many
    3: (lambda: max(2**k for k in range(4, 24) if ringmem_fits(8, 2**k, 4 * 2**30)),
        [65536, 131072, 4096])}  # rounded up (4.55 GiB); attention's tensors alone; a rank's tokens, not T


# 05i_ulysses: Ulysses' all-to-alls and Llama 3's all-gather over 50 GB/s links (09b's collective_s, NIC),
# and a whole step's Ulysses term (09c's step_time with Layout(cp=..., cp_impl="ulysses"))

ULY_PIECE = (131072 // 8) * 128 * 2  # bytes of one head's (T/cp, hs) numbers in bf16, cp = 8


def ulysses_step_s(cp, T):
    "The planner's Ulysses all-to-alls of one step: GPT-2 small, bf16, one sequence of T tokens, 50 GB/s."
    return step_time(GPT2, Layout(cp=cp, cp_impl="ulysses"), T, NIC)["cp"]


PROBLEMS["05i_ulysses"] = {
    1: (lambda: sum(collective_s(NIC, "all_to_all", h * ULY_PIECE, 8) for h in (32, 8, 8, 32)),
        [128 * ULY_PIECE * 7 / 8 / 50e9,  # GQA forgotten: k and v with 32 heads
         80 * ULY_PIECE / 50e9,  # whole tensors, the (cp - 1)/cp that leaves forgotten
         2 * 80 * ULY_PIECE * 7 / 8 / 50e9]),  # forward and backward
    2: (lambda: next(cp for cp in (2, 3, 4, 6, 12) if ulysses_step_s(cp, 65536) <= 0.030),
        [4, 12, 8]),  # 36.2 ms, just over; the largest, not the smallest; 8 does not divide 12 heads
    3: (lambda: collective_s(NIC, "all_gather", 8 * 2 * 8 * ULY_PIECE, 8),
        [8 * 2 * 8 * ULY_PIECE / 50e9,  # cp pieces, not cp - 1 (a rank's own stays)
         7 * 8 * ULY_PIECE / 50e9,  # K without V
         80 * ULY_PIECE * 7 / 8 / 50e9])}  # Ulysses' all-to-alls (Problem 1), the other method


# GPT-2 small with GShard's experts: 8, top-2, in every other block (6 MoE layers)
experts_GSHARD = Shape(name="gpt2-small, 8 experts every other block", n_layer=12, n_embd=768, n_head=12,
                       vocab_size=50257, n_positions=1024, n_expert=8, top_k=2, moe_every=2)
experts_MLP = 8 * 768 * 768 + 5 * 768  # one expert: 4,722,432 parameters
PROBLEMS["05j_experts"] = {
    1: (lambda: n_params(experts_GSHARD)["total"],
        [PSI + 6 * 8 * experts_MLP + 6 * 768 * 8,    # 8 new experts a block: the dense MLP not expert 0
         PSI + 12 * (7 * experts_MLP + 768 * 8),     # experts in every block
         PSI + 6 * 7 * experts_MLP,                  # the routers left out
         n_params(experts_GSHARD)["active"]]),       # what a token uses, not what the model holds
    2: (lambda: flops_token(experts_GSHARD, 1024),
        [6 * (n_params(experts_GSHARD)["total"] - 1024 * 768) + 12 * 12 * 768 * 1024,  # every expert counted
         6 * (n_params(experts_GSHARD)["active"] - 1024 * 768),  # attention's 12·L·C·T forgotten
         2 * (n_params(experts_GSHARD)["active"] - 1024 * 768) + 4 * 12 * 768 * 1024,  # the forward alone
         flops_token(GPT2, 1024)]),  # the dense model's: the second expert forgotten
    3: (lambda: first(lambda e: n_params(replace(experts_GSHARD, n_expert=e, top_k=1, moe_every=1))["total"]
                      >= 1e9),
        [18, 16, 15]),  # 1e9 / (12 experts) rounded up, the dense part forgotten; 15.45 (experts added) as E
}


# 05ja_layout
LAYOUT_XL = Shape(name="gpt2-xl", n_layer=48, n_embd=1600, n_head=25, vocab_size=50257, n_positions=1024)
LAYOUT_MEDIUM = Shape(name="gpt2-medium", n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, n_positions=1024)
LAYOUT_NODE = Profile("8 GPUs, memory no object", 8, 1e15, 1.0, 1e18, (0.0, 50e9), (0.0, 50e9), "fp32")


def layout_count(s, global_batch) -> int:
    "How many (tp, cp, pp) of 8 GPUs the planner lists for `s`: 1024 tokens, ring, 1F1B, micro-batches of 1."
    return len(layouts(s, 8, global_batch, 1024, LAYOUT_NODE, zero_stages=(0,), schedules=("1f1b",),
                       cp_impls=("ring",), batch_sizes=(1,), recompute=(False,)))


PROBLEMS["05ja_layout"] = {
    1: (lambda: next(dp for dp in range(1, 65) if Layout(dp=dp, tp=4, cp=2, pp=2).world == 64),
        [16, 8, 32]),  # tp alone; cp left out (dp x cp: the gradients' group, not the replicas); one degree of 2
    2: (lambda: layout_count(LAYOUT_XL, 64),  # 64 sequences: 64 / dp >= 8 micro-batches, enough for any pp
        [20, 64, 4]),  # the 25 heads forgotten (any tp); every triple of divisors of 8; one degree at a time
    3: (lambda: layout_count(LAYOUT_MEDIUM, 4),
        [19, 20, 9]),  # 1F1B's m >= pp forgotten; the batch forgotten; dp = 1 only
}


# GPT-2 small with 16 experts, top-2, in every other block; 4 processes, ep 4, micro-batches of 4 x 1024 tokens
router_MOE = Shape(name="gpt2-small, 16 experts every other block", n_layer=12, n_embd=768, n_head=12,
                   vocab_size=50257, n_positions=1024, n_expert=16, top_k=2, moe_every=2)
router_LAYOUT = Layout(dp=4, ep=4, grad_accum=2, batch_size=4)


def router_ep_s(p) -> float:
    "Seconds of a step's expert all-to-alls in the planner's step_time (bf16 profiles: 2 bytes a number)."
    return step_time(router_MOE, router_LAYOUT, 1024, p)["ep"]


router_BYTES = 4 * 6 * 2 * 2 * 4096 * 768 * 2  # 48 all-to-alls' payloads, the rows staying home included
PROBLEMS["05jb_router"] = {
    1: (lambda: block_matmuls(router_MOE, 4 * 1024, 1, 4)["expert 0 up"][0],
        [512, 1024, 8192]),  # one rank's rows only; k forgotten; the rank's 4 experts together
    2: (lambda: router_ep_s(NIC) * 50e9,  # NIC: 50 GB/s, no latency: seconds x bandwidth = bytes sent
        [router_BYTES * 3 / 4 / 2,   # the forward alone
         router_BYTES,               # the rows that stay home counted
         router_BYTES * 3 / 4 * 2]),  # fp32's 4 bytes a number
    3: (lambda: router_ep_s(PROFILES["h100-node"]),  # NVLink: 5 us a hop, 450 GB/s
        [router_BYTES * 3 / 4 / 450e9,                # latency left out
         48 * 5e-6 + router_BYTES * 3 / 4 / 450e9,    # one latency a call, not ep - 1
         24 * 15e-6 + router_BYTES * 3 / 8 / 450e9]),  # the forward's 24 calls alone
}


# 05k_mesh
MESH_MEDIUM = Shape(name="gpt2-medium", n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, n_positions=1024)
MESH_PSI = 354_823_168  # GPT-2 medium's parameters, as the problems state them


def mesh_state(L, stage) -> float:
    "Bytes of model state a rank of `stage` holds in the planner's memory model: GPT-2 medium, fp32."
    m = memory(MESH_MEDIUM, L, 1024, "fp32", stage)
    return m["params"] + m["grads"] + m["optimizer"]


def mesh_sent(L) -> float:
    "Bytes one rank sends summing GPT-2 small's fp32 gradients on the mesh (the planner's dp_messages), ring."
    return sum(b * k * bus_factor(name, n) for name, b, n, k in dp_messages(GPT2, L, 4 * rank_params(GPT2, L)))


PROBLEMS["05k_mesh"] = {
    1: (lambda: rank_params(MESH_MEDIUM, Layout(dp=2, tp=2, pp=4), stage=1),
        [MESH_PSI // 8, 75_577_344, MESH_PSI // 16]),  # tables spread over stages; tp forgotten; dp as shares
    2: (lambda: max(mesh_state(Layout(dp=2, tp=2, pp=4, zero_stage=1), s) for s in range(4)),
        [16 * 90_318_848, 12 * 89_272_320, 12 * MESH_PSI / 8]),  # no ZeRO; the last stage; tables cut too
    3: (lambda: mesh_sent(Layout(dp=4, tp=2, cp=2)),  # + the loss's 4 bytes, which the problem leaves out
        [2 * 3 / 4 * 4 * 81_940_224, 2 * 7 / 8 * 4 * PSI / 2, 7 / 8 * 4 * 81_940_224]),  # dp's 4 alone; Ψ/2; one pass
}


# 05l_engines
ENGINES_MEDIUM = Shape(name="gpt2-medium", n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, n_positions=1024)
ENGINES_XL = Shape(name="gpt2-xl", n_layer=48, n_embd=1600, n_head=25, vocab_size=50257, n_positions=1024)
ENGINES_PSI_MEDIUM, ENGINES_PSI_XL = 354_823_168, 1_557_611_200  # as the problems state them


def engines_state(s, L, dtype="fp32") -> float:
    "Bytes of model state a rank holds in the planner's memory model (params, gradients, optimizer)."
    m = memory(s, L, 1024, dtype)
    return m["params"] + m["grads"] + m["optimizer"]


PROBLEMS["05l_engines"] = {
    1: (lambda: engines_state(ENGINES_MEDIUM, Layout(dp=4, zero_stage=1)),  # DDP (the whole state loaded);
        [16 * ENGINES_PSI_MEDIUM, 11 * ENGINES_PSI_MEDIUM, 4 * ENGINES_PSI_MEDIUM]),  # + DeepSpeed's master; z3
    2: (lambda: engines_state(ENGINES_XL, Layout(dp=8, zero_stage=2), "bf16")
        - engines_state(ENGINES_XL, Layout(dp=8, zero_stage=3), "bf16"),  # ZeRO-3's eighth forgotten;
        [2 * ENGINES_PSI_XL, 7 / 8 * 4 * ENGINES_PSI_XL, 2 * ENGINES_PSI_XL / 8]),  # fp32 weights; what z3 keeps
    3: (lambda: first(lambda n: engines_state(ENGINES_XL, Layout(dp=n, zero_stage=3), "bf16") <= 4 * 2**30),
        [5, 7, 8]),  # rounded down; 4 GB for 4 GiB; a power of two
}


# GPT-2 small with 8 experts, top-2, in every block, on 8 processes in fp32 with AdamW
expert_trainer_MOE = Shape(name="gpt2-small, 8 experts every block", n_layer=12, n_embd=768, n_head=12,
                           vocab_size=50257, n_positions=1024, n_expert=8, top_k=2)


def expert_trainer_state(ep) -> float:
    "Bytes of fp32 model state (weights, gradients, AdamW) one rank holds at `ep` on 8 processes: the planner's."
    m = memory(expert_trainer_MOE, Layout(dp=8, ep=ep), 1024, "fp32")
    return m["params"] + m["grads"] + m["optimizer"]


expert_trainer_TOTAL = 521_197_824  # the whole model's parameters
expert_trainer_ROUTERS = 12 * 768 * 8
PROBLEMS["05m_expert_trainer"] = {
    1: (lambda: rank_params(expert_trainer_MOE, Layout(dp=8, ep=2)),
        [expert_trainer_TOTAL / 2,  # everything halved, the dense part too
         rank_params(expert_trainer_MOE, Layout(dp=8, ep=8)),  # the experts cut by the 8 processes
         rank_params(expert_trainer_MOE, Layout(dp=8, ep=2)) - expert_trainer_ROUTERS / 2]),  # routers cut too
    2: (lambda: expert_trainer_state(8),
        [12 * rank_params(expert_trainer_MOE, Layout(dp=8, ep=8)),  # the gradients forgotten
         16 * expert_trainer_TOTAL,       # ep 1's: every expert
         16 * expert_trainer_TOTAL / 8]),  # all of it cut by 8, as ZeRO-3 would
    3: (lambda: first(lambda ep: 8 % ep == 0 and expert_trainer_state(ep) <= 3 * 2**30),
        [3, 2, 8]),  # the whole state cut by ep (2.59 -> 3, not a divisor); ep 2 (4.39 GiB); one expert a rank
}


def problem_cells(name) -> dict:
    "{k: the source of `Problem k`'s code cell} of a lesson, in order."
    out, k = {}, None
    for cell in json.loads((ROOT / "nbs" / f"{name}.ipynb").read_text())["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and (m := re.match(r"### Problem (\d+)", text)): k = int(m[1])
        elif cell["cell_type"] == "code" and k is not None: out[k], k = text, None
    return out


@lru_cache(maxsize=None)
def answers(name) -> dict:
    """{k: (the answer `Problem k`'s cell hands check_prediction, its rel)}: the lesson's imports, then its problem
    cells in order, run as a learner runs them with `guess = None` (the answer is not printed: it is recorded)."""
    cells = json.loads((ROOT / "nbs" / f"{name}.ipynb").read_text())["cells"]
    module = re.search(r"#\| default_exp (\S+)", "\n".join("".join(c["source"]) for c in cells))[1]
    imports = [line for c in cells if c["cell_type"] == "code" for line in "".join(c["source"]).splitlines()
               if re.match(r"(from \S+ )?import [^(]+$", line)]  # one-line imports, exported cells' and others'
    calls = []
    def record(guess, answer, rel=0.01, unit=""): calls.append((answer, rel))
    ns = {}
    exec("\n".join([*imports, f"from distcourse.{module} import *"]), ns)
    with patch.object(memory_module, "check_prediction", record):
        for k, code in problem_cells(name).items():
            assert "check_prediction(guess" in code, f"{name} problem {k}: its cell does not check a prediction"
            ns["check_prediction"] = record
            exec(code, ns)
            assert ns["guess"] is None, f"{name} problem {k}: committed with a guess filled in"
            assert len(calls) == k, f"{name} problem {k}: check_prediction called {len(calls) - k + 1} times"
    return dict(enumerate(calls, 1))


CASES = [(name, k) for name, probs in PROBLEMS.items() for k in probs]


def test_every_parallelism_lesson_has_a_problem_set():
    "Lessons 05 to 05m each have their problems checked here: a new parallelism lesson brings its own."
    assert sorted(PROBLEMS) == sorted(p.stem for p in (ROOT / "nbs").glob("05*.ipynb"))


@pytest.mark.parametrize("name", PROBLEMS)
def test_lesson_has_a_problem_set(name):
    "3-6 problems, numbered from 1, each with its cell and a folded worked answer after it."
    cells = json.loads((ROOT / "nbs" / f"{name}.ipynb").read_text())["cells"]
    heads = [i for i, c in enumerate(cells) if re.match(r"### Problem \d+", "".join(c["source"]))]
    assert 3 <= len(heads) <= 6 and sorted(answers(name)) == list(range(1, len(heads) + 1)) == sorted(PROBLEMS[name])
    for i in heads:
        assert cells[i + 1]["cell_type"] == "code", name
        assert "".join(cells[i + 2]["source"]).startswith("<details><summary>Worked answer"), (name, i)


def test_the_problems_are_on_the_planners_gpt2_small():
    assert rank_params(GPT2, Layout(dp=8)) == PSI


@pytest.mark.parametrize("name,k", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_answer_is_the_planners(name, k):
    "The lesson's answer, from its own functions, equals the planner's to the 6 digits printed."
    want, _ = PROBLEMS[name][k]
    assert answers(name)[k][0] == pytest.approx(want(), rel=1e-5)


@pytest.mark.parametrize("name,k", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_wrong_answers_are_refused(name, k, capsys):
    "check_prediction accepts the planner's answer and refuses each plausible wrong one, naming the right one."
    want, wrong = PROBLEMS[name][k]
    answer, rel = answers(name)[k]
    check_prediction(want(), answer, rel)
    assert "your prediction is right" in capsys.readouterr().out
    for w in wrong:
        with pytest.raises(AssertionError, match="answer: "): check_prediction(w, answer, rel)
