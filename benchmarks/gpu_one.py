"""What one GPU shows that the CPU cannot: the first thing to run on a machine with a single CUDA GPU.

    python benchmarks/gpu_one.py                          # every section; the runs in gpu_one_out/, gpu_one.json
    python benchmarks/gpu_one.py --only facts,train --json f.json   # some sections

Sections, each in its own processes (a section that fails is recorded and the next one runs):
- facts: the device, torch, CUDA and NCCL versions, and the measured 8192^3 matmul rate in bf16, fp16, TF32 and
  fp32 (the ceilings against which the datasheet's peaks and the runs' MFU are read);
- forks: whether a process forked after nothing, a CPU backward pass, or CUDA set up can train (launch's probe);
- nccl: a one-process NCCL group (all-reduce, broadcast, all-gather of CUDA tensors). Two ranks cannot share one GPU
  under NCCL, so nothing here checks the pairing of messages across ranks: gpu_check.py does that on 2+ GPUs;
- train: the main job (`python -m distcourse.train`, its defaults) at fp32, bf16, fp16 and `auto`: final perplexity,
  wall seconds, tokens/s and MFU from run.json and metrics.jsonl; then a larger shape for MFU;
- plugins: Accelerate's FSDP2, DeepSpeed ZeRO-2 and ZeRO-3-offload configs on one process, the tiny model in fp32 for
  20 steps, compared with the plain one-process run of the same flags as gpu_check.py compares (each step's loss and
  gradient norm, every parameter's gradient at step 1);
- lessons: lesson 02a (its launches) and the `#| gpu` cells of lessons 04, 04a and 08, each lesson's code cells run
  top to bottom in one interpreter at test sizes (IN_TEST=1), as `nbdev_test --flags gpu` runs them.
"""
import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("facts", "nccl", "forks", "train", "plugins", "lessons")
LESSONS = ("02a_launch", "04_mixed_precision", "04a_precision_choice", "08_tracking")  # each launches, or has gpu cells
TINY = ["--config", "configs/tiny.yaml", "--max_steps", "20", "--log_every", "1", "--eval_every", "0",
        "--grads_at", "1", "--mixed_precision", "no", "--compile", "false", "--tracker", "none"]


def rate(n, dtype, tf32=False, reps=10) -> float:
    "FLOP/s of an n x n x n matmul in `dtype` on the GPU (CUDA events; 3 warm-ups, the mean of `reps`)."
    import torch
    torch.backends.cuda.matmul.allow_tf32 = tf32
    a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
    for _ in range(3): a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps): a @ b
    end.record(); torch.cuda.synchronize()
    torch.backends.cuda.matmul.allow_tf32 = False
    return 2 * n ** 3 * reps / (start.elapsed_time(end) / 1e3)


def installed(name) -> str:
    "The version of an installed package, or 'not installed'."
    from importlib.metadata import PackageNotFoundError, version
    try: return version(name)
    except PackageNotFoundError: return "not installed"


def facts() -> dict:
    "The device, the software, the matmul rates."
    import torch
    from distcourse.tracking import DATASHEET_FLOPS, datasheet_gpu
    p, name = torch.cuda.get_device_properties(0), torch.cuda.get_device_name(0)
    out = {"device": name, "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
           "memory_gib": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count,
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "card": datasheet_gpu(name),
           "packages": {k: installed(k) for k in ("transformers", "accelerate", "datasets", "deepspeed")}}
    out["datasheet"] = DATASHEET_FLOPS.get(out["card"])
    out["tflops"] = {k: round(rate(8192, dt, tf32) / 1e12, 1) for k, dt, tf32 in
                     (("bf16", torch.bfloat16, False), ("fp16", torch.float16, False),
                      ("tf32", torch.float32, True), ("fp32", torch.float32, False))}
    return out


def nccl() -> dict:
    "A one-process NCCL group: each collective's result checked."
    import torch
    import torch.distributed as dist
    from distcourse.launch import free_port
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    x = torch.arange(4.0, device="cuda")
    dist.all_reduce(x); dist.broadcast(x, 0)
    out = [torch.empty_like(x)]
    dist.all_gather(out, x); torch.cuda.synchronize()
    ok = torch.equal(out[0], torch.arange(4.0, device="cuda"))
    dist.destroy_process_group()
    return {"backend": "nccl", "world_size": 1, "collectives_equal": bool(ok)}


def why(stderr) -> str:
    "The errors a failed process printed (a launcher's own report comes last and names none), then its last lines."
    errors = [line.strip() for line in stderr.splitlines()
              if re.match(r"\s*[\w.]*(Error|Exception)\b.*:", line) or re.search(r"\berror\b", line, re.I)]
    return "\n".join(dict.fromkeys(errors[-8:])) + "\n...\n" + stderr.strip()[-600:]


PROBE = """import multiprocessing, torch
from distcourse.launch import _backward_once
{setup}
probe = multiprocessing.get_context("fork").Process(target=_backward_once); probe.start(); probe.join(60)
print(probe.exitcode)"""


def forks() -> dict:
    "The exit code of launch's fork probe (0: a fork can train) after nothing, a CPU backward, CUDA set up."
    setups = {"fresh process": "", "after a CPU backward": "torch.ones(1, requires_grad=True).sum().backward()",
              "after CUDA set up": "torch.ones(1, device='cuda')"}
    return {k: subprocess.run([sys.executable, "-c", PROBE.format(setup=v)], capture_output=True, text=True,
                              timeout=120, cwd=ROOT).stdout.strip() for k, v in setups.items()}


def trainer(args, out, launcher=(), timeout=600) -> dict:
    "Run the trainer; what its run.json and metrics.jsonl say, or why it failed."
    head = ["accelerate.commands.launch", *launcher, "-m"] if launcher else []
    cmd = [sys.executable, "-m", *head, "distcourse.train", *args, "--output_dir", str(out)]
    t0 = time.time()
    res = {"cmd": " ".join(cmd[1:])}
    try: proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired: return {**res, "error": f"timed out after {timeout} s"}
    res["wall_s"] = round(time.time() - t0, 1)
    if proc.returncode:  # all it printed kept beside the run, for reading later
        out.mkdir(parents=True, exist_ok=True); (out / "output.txt").write_text(proc.stdout + proc.stderr)
        return {**res, "error": why(proc.stdout + proc.stderr)}
    run = json.loads((out / "run.json").read_text())
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in recs if "split" not in r and "loss" in r]
    rates = sorted(r["tokens_per_s"] for r in train[len(train) // 4:] if "tokens_per_s" in r)  # past warm-up
    return {**res, "final": run.get("final"), "choices": run.get("choices"), "distributed_type":
            run.get("distributed_type"), "mixed_precision": run.get("mixed_precision"),
            "utilisation": run.get("utilisation"), "tokens_per_s_median": rates[len(rates) // 2] if rates else None,
            "peak_first_step": run.get("memory", {}).get("peak_first_step"),
            "steps": [(r["step"], r["loss"], r.get("grad_norm")) for r in train]}


def train(out) -> dict:
    "The main job at each precision, then a larger shape for MFU."
    res = {}
    for mp in ("no", "bf16", "fp16", "auto"):  # eager but for auto (which compiles from 300 steps on a GPU)
        flags = ["--mixed_precision", mp, "--tracker", "none", *(["--compile", "false"] if mp != "auto" else [])]
        res[f"main_{mp}"] = trainer(flags, out / f"main_{mp}", timeout=240)
        print("train", mp, {k: v for k, v in res[f"main_{mp}"].items() if k in ("wall_s", "final", "error")},
              flush=True)
    res["large_bf16"] = trainer(["--model", "base", "--batch_size", "32", "--seq_len", "512", "--max_steps", "60",
                                 "--eval_every", "0", "--mixed_precision", "bf16", "--compile", "false",
                                 "--tracker", "none"], out / "large_bf16", timeout=240)
    return res


def plugins(out, names=("fsdp2", "zero2", "zero3_offload")) -> dict:
    "Accelerate's plugins on one process against the plain process, compared as gpu_check.py compares layouts."
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    spec.loader.exec_module(check := importlib.util.module_from_spec(spec))
    res = {"plain": trainer(TINY, out / "plain")}
    for name in names:
        r = trainer([*TINY, "--zero_stage", "0"], out / name,
                    launcher=("--config_file", f"configs/accelerate/{name}.yaml", "--num_processes", "1",
                              "--mixed_precision", "no"), timeout=240)
        if "error" not in r and "error" not in res["plain"]:
            r["compared"] = check.compare(check.result(out / "plain"), check.result(out / name), 1e-5)
        res[name] = r
        print("plugin", name, {k: r.get(k) for k in ("distributed_type", "compared", "error")}, flush=True)
    return res


def run_lesson(path):
    "Run a lesson's code cells in order in this interpreter (cwd nbs/, IN_TEST=1), skipping slow and eval: false."
    os.environ["IN_TEST"] = "1"; os.environ.setdefault("MPLBACKEND", "Agg")
    cells = json.loads(Path(path).read_text())["cells"]
    os.chdir(ROOT / "nbs"); sys.path.insert(0, str(ROOT))
    ns = {"__name__": "__main__"}
    for i, cell in enumerate(cells):
        src = "".join(cell["source"])
        if cell["cell_type"] != "code" or "#| slow" in src or "#| eval: false" in src: continue
        t0 = time.time(); print(f"[cell {i}]", flush=True)
        exec(compile(src, f"{Path(path).stem}[{i}]", "exec"), ns)
        if "#| gpu" in src: print(f"--- gpu cell {i} ran in {time.time() - t0:.1f} s", flush=True)


def lessons(out) -> dict:
    "Each lesson in its own interpreter; its printed output kept."
    res = {}
    for name in LESSONS:
        t0 = time.time()
        try: proc = subprocess.run([sys.executable, __file__, "--lesson", str(ROOT / "nbs" / f"{name}.ipynb")],
                                   capture_output=True, text=True, timeout=240, cwd=ROOT)
        except subprocess.TimeoutExpired as e:
            res[name] = {"ok": False, "error": "timed out after 240 s", "output": str(e.stdout)[-3000:]}
            continue
        res[name] = {"ok": proc.returncode == 0, "wall_s": round(time.time() - t0, 1), "output": proc.stdout[-3000:],
                     **({"error": why(proc.stdout + proc.stderr)} if proc.returncode else {})}
        print("lesson", name, res[name]["ok"], res[name]["wall_s"], flush=True)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_one.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_one_out", help="where the runs go")
    p.add_argument("--json", default="gpu_one.json", help="where the results go (written after each section)")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {', '.join(SECTIONS)}")
    p.add_argument("--plugins", default="fsdp2,zero2,zero3_offload", help="the plugins section's configs")
    p.add_argument("--lesson", help=argparse.SUPPRESS)  # internal: run one lesson's cells in this process
    a = p.parse_args(argv)
    if a.lesson: return run_lesson(a.lesson)
    out, results = Path(a.out).resolve(), {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    out.mkdir(parents=True, exist_ok=True)
    for name in a.only.split(","):
        t0 = time.time()
        kw = {"names": a.plugins.split(",")} if name == "plugins" else {}
        fn = globals()[name]
        try: results[name] = fn() if name in ("facts", "nccl", "forks") else fn(out / name, **kw)
        except Exception as e: results[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"== {name}: {time.time() - t0:.0f} s", flush=True)
        Path(a.json).write_text(json.dumps(results, indent=1, default=str))  # kept if a later one hangs
    print(json.dumps(results, indent=1, default=str)[:6000])


if __name__ == "__main__":
    main()
