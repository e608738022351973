"""The planner's GPU model (lessons 09bb, 09c) against one GPU: what its terms predict, beside what the GPU does.

    python benchmarks/gpu_plan.py                 # on a machine with a CUDA GPU: benchmarks/gpu_plan.json
    python benchmarks/gpu_plan.py --profile a100-node --json /tmp/gpu_plan.json

Until it runs on a GPU, `gpu_plan.json` says "not run" and lists what it will measure. Each section prints and
records the measured figure beside the prediction from the profile (the datasheet's, as 09b's PROFILES hold it):
- matmul: bf16 (m x 4096) @ (4096 x 4096) for m from 8 to 16,384 rows, CUDA events: TFLOP/s against 09bb's
  `matmul_s` (the roofline of the profile's peak x mm_frac and its memory bandwidth);
- bandwidth: a 2 GiB bf16 copy, bytes read and written per second, against the profile's `mem_bw`;
- kernels: a block's memory-bound forward kernels at Llama-like widths (LayerNorm, the residual add, SwiGLU's
  silu-and-product) on 8,192 tokens, against 09bb's `kernel_bytes` at the measured bandwidth;
- step: the course's GPT (01a) at `base` width, 12 layers, 8 x 1,024 tokens in bf16 autocast, forward, backward and
  AdamW, against 09c's `predict` for one GPU (Layout(1)), with the profile's peak, and with the measured matmul rate.
One GPU cannot show the links: the collectives are benchmarks/gpu_check.py's (2+ GPUs, NCCL).
"""
import argparse
import json
import sys
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
WHAT = ["matmul: bf16 (m x 4096) @ (4096 x 4096), m = 8 ... 16384: TFLOP/s against gpu_costs.matmul_s",
        "bandwidth: a 2 GiB bf16 copy against the profile's mem_bw",
        "kernels: LayerNorm, residual add, SwiGLU on 8192 tokens against gpu_costs.kernel_bytes",
        "step: the course's GPT, base width, 12 layers, 8 x 1024 tokens, bf16: seconds against plan.predict"]


def timed(fn, reps=20) -> float:
    "Seconds of fn() on the GPU: CUDA events, 3 warm-ups, the mean of `reps`."
    import torch
    for _ in range(3): fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps): fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def matmuls(p) -> list:
    import torch
    from distcourse.gpu_costs import matmul_s
    w, out = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16), []
    for m in (8, 32, 128, 512, 2048, 8192, 16384):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        s = timed(lambda: x @ w)
        out.append({"rows": m, "measured_tflops": 2 * m * 4096**2 / s / 1e12,
                    "predicted_tflops": 2 * m * 4096**2 / matmul_s(p, m, 4096, 4096) / 1e12})
    return out


def bandwidth() -> float:
    import torch
    a = torch.empty(2**30, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    return 2 * a.numel() * 2 / timed(lambda: b.copy_(a))


def kernels(p, bw) -> dict:
    import torch
    import torch.nn.functional as F
    from distcourse.gpu_costs import kernel_bytes
    from distcourse.sizes import Shape
    s = Shape("llama-like", 1, 4096, 32, 32000, n_positions=0, d_ff=14336, n_kv_head=8)
    T, dev, dt = 8192, "cuda", torch.bfloat16
    x, r = torch.randn(T, 4096, device=dev, dtype=dt), torch.randn(T, 4096, device=dev, dtype=dt)
    gate, up = torch.randn(T, 14336, device=dev, dtype=dt), torch.randn(T, 14336, device=dev, dtype=dt)
    norm = torch.nn.LayerNorm(4096, device=dev, dtype=dt)
    measured = 2 * timed(lambda: norm(x)) + 2 * timed(lambda: x + r) + timed(lambda: F.silu(gate) * up)
    want = kernel_bytes(s, T)
    predicted = (want["norms"] + want["residual adds"] + want["activation"]) / bw
    return {"measured_s": measured, "predicted_s": predicted, "predicted_at_datasheet_s": predicted * bw / p.mem_bw}


def step(p, mm_tflops) -> dict:
    import torch
    from distcourse.gpt import GPT, GPTConfig
    from distcourse.planner import Layout, predict
    from distcourse.sizes import Shape
    cfg = GPTConfig(50304, 1024, 12, 12, 768)
    model = GPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randint(0, cfg.vocab_size, (8, 1024), device="cuda")

    def one():
        with torch.autocast("cuda", torch.bfloat16): loss = model(x, targets=x)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    measured = timed(one, reps=10)
    shape = Shape("base-gpt2", 12, 768, 12, 50304, 1024)
    pred = predict(shape, Layout(1, batch_size=8), 1024, p)
    tuned = predict(shape, Layout(1, batch_size=8), 1024, replace(p, mm_frac=mm_tflops * 1e12 / p.flops))
    return {"measured_s": measured, "predicted_s": pred["step_s"], "terms": pred["time"],
            "predicted_at_measured_matmul_rate_s": tuned["step_s"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="h100-node", help="the datasheet profile to predict with (09b's PROFILES)")
    ap.add_argument("--json", default=str(HERE / "gpu_plan.json"))
    a = ap.parse_args(argv)
    import torch
    from distcourse.machine import load_profile
    if not torch.cuda.is_available():
        sys.exit("gpu_plan.py needs a CUDA GPU; gpu_plan.json keeps saying 'not run'. On a GPU machine: "
                 "python benchmarks/gpu_plan.py")
    p = load_profile(a.profile)
    out = {"status": "run", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "profile": asdict(p), "what": WHAT}
    out["matmul"] = matmuls(p)
    out["bandwidth_bytes_s"] = bandwidth()
    out["kernels"] = kernels(p, out["bandwidth_bytes_s"])
    out["step"] = step(p, max(r["measured_tflops"] for r in out["matmul"]))
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "profile"}, indent=1))


if __name__ == "__main__":
    main()
