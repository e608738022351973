"""Ratios that hold from run to run, and time to the same validation loss.

What each contender is in a round (pairing.py holds the rounds and the statistics): the course's step on
one path, the trainer launched with its defaults, transformers.Trainer; and the two trainers' validation
curves, for the training seconds each needs to reach the same loss.
"""
import json
import statistics
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from accelerate.state import AcceleratorState, GradientState, PartialState
from transformers import TrainerCallback

from bench_steps import Bench, DistcourseStep, make_hf_trainer, sync, timed
from pairing import crossing, summary_line


@contextmanager
def own_state(mine: dict):
    "Run the body in a contender's own Accelerate state (kept in `mine` between calls); the process's back after."
    classes = (PartialState, AcceleratorState, GradientState)
    saved = {cls: dict(cls._shared_state) for cls in classes}
    for cls in classes: cls._shared_state.clear(); cls._shared_state.update(mine.get(cls, {}))
    try: yield
    finally:
        for cls in classes:
            mine[cls] = dict(cls._shared_state)
            cls._shared_state.clear(); cls._shared_state.update(saved[cls])


class StepRuns:
    "The course's step on one path (precision, compile): a call runs one untimed step, then `n` timed; tokens/s."
    def __init__(self, b: Bench, n: int):
        from distcourse.launch import make_accelerator
        self.state, self.n, self.device = {}, n, b.device
        with own_state(self.state):
            acc = make_accelerator(mixed_precision="bf16" if b.precision == "bf16" else "no")
            self.step = DistcourseStep(replace(b, steps=10_000), acc)  # the schedule never ends inside a run

    def __call__(self) -> float:
        with own_state(self.state):
            timed(self.step, 1, self.device)
            seconds, work = timed(self.step, self.n, self.device)
        return work / seconds


class _Clock(TrainerCallback):
    "The time at the end of every Trainer step (the device drained)."
    def __init__(self, device): self.device, self.ticks = device, []
    def on_train_begin(self, args, state, control, **kw): self.ticks = []
    def on_step_end(self, args, state, control, **kw): sync(self.device); self.ticks.append(time.perf_counter())


class TrainerRuns:
    "transformers.Trainer on `b`'s path: a call trains one untimed step, then `n` timed (its loop included); tokens/s."
    def __init__(self, b: Bench, n: int, out_dir):
        self.state, self.n, self.clock, self.tokens = {}, n, _Clock(b.device), b.batch_size * b.seq_len
        with own_state(self.state): self.trainer = make_hf_trainer(b, out_dir, [self.clock], max_steps=1 + n)

    def __call__(self) -> float:
        with own_state(self.state): self.trainer.train()  # optimizer and schedule kept from call to call
        t = self.clock.ticks
        return self.tokens * self.n / (t[-1] - t[0])


def job_config(b: Bench, steps, out_dir, compile="true", **kw):
    "The trainer with its defaults (auto's measured precision, AdamW, its schedule) on `b`'s model and shape, compiled."
    from distcourse.train import Config
    return Config(model=b.model, batch_size=b.batch_size, seq_len=b.seq_len, max_steps=steps, tracker="none",
                  output_dir=str(out_dir), compile=compile,  # "true": what auto measured for the main job's 450 steps
                  **{"eval_every": 0, "log_every": 5} | kw)


class MainJobRuns:
    "The trainer itself, launched as `accelerate launch -m distcourse.train` runs it: a call is one short run."
    def __init__(self, b: Bench, steps: int, log_every: int, out_dir, compile="true"):
        self.b, self.steps, self.log_every, self.out, self.runs = b, steps, log_every, Path(out_dir), []
        self.compile = compile

    def __call__(self) -> float:
        from distcourse.launch import launch
        from distcourse.tracking import read_metrics
        from distcourse.train import train
        cfg = job_config(self.b, self.steps, self.out / f"main_job{len(self.runs)}", self.compile,
                         log_every=self.log_every)
        self.runs.append(launch(train, (cfg,), num_processes=1))  # a forked process, a fresh Accelerate state
        windows = [r["tokens_per_s"] for r in read_metrics(cfg.output_dir)["train"][2:]]  # compile, warm-up out
        return statistics.median(windows)


# ------------------------------------------------------------------------- time to the same validation loss
def trainer_curve(b: Bench, steps, every, out_dir, compile="true") -> list:
    "The course's trainer with its defaults: (training seconds, step, validation loss) every `every` steps."
    from distcourse.launch import launch
    from distcourse.tracking import read_metrics
    from distcourse.train import train
    cfg = job_config(b, steps, out_dir, compile, eval_every=every, log_every=every)
    summary = launch(train, (cfg,), num_processes=1)
    m = read_metrics(cfg.output_dir)
    seconds, tokens, busy = {0: 0.0}, 0, 0.0  # the meter's seconds of steps: evaluation and logging left out
    for r in m["train"]:
        busy += (r["tokens"] - tokens) / r["tokens_per_s"]; tokens = r["tokens"]
        seconds[r["step"]] = busy
    return [(seconds[r["step"]], r["step"], r["loss"]) for r in m["val"]], summary


class _EvalEvery(TrainerCallback):
    "Every `every` steps (and at step 0), the validation loss the course's trainer computes; its time left out."
    def __init__(self, val_dl, every):
        self.val_dl, self.every, self.points, self.busy, self.acc = val_dl, every, [], 0.0, None

    def evaluate(self, model, step):
        from distcourse.evaluation import evaluate_distributed
        self.points.append((self.busy, step, evaluate_distributed(self.acc, model, self.val_dl, "clm")["loss"]))

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.evaluate(model, 0); self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step % self.every and state.global_step != state.max_steps: return
        self.busy += time.perf_counter() - self.t0
        self.evaluate(model, state.global_step); self.t0 = time.perf_counter()


def hf_curve(b: Bench, steps, every, out_dir, warmup_steps) -> list:
    "transformers.Trainer with its defaults (fp32, eager): (training seconds, step, validation loss)."
    from distcourse.data import get_tokenizer
    from distcourse.loaders import get_dataloaders
    _, val_dl = get_dataloaders("clm", get_tokenizer("stdlib"), b.seq_len, b.batch_size, seed=b.seed)
    ev, state = _EvalEvery(val_dl, every), {}
    with own_state(state):
        trainer = make_hf_trainer(replace(b, precision="fp32", compile=False), out_dir, [ev], max_steps=steps,
                                  warmup_steps=warmup_steps)
        ev.acc = trainer.accelerator  # its single process: the whole validation set, once
        trainer.train()
    return ev.points


def time_to_loss(b: Bench, steps: int, every: int, tmp, per_step_ratio=None, compile="true") -> dict:
    "Training seconds each needs to reach the worse of the two final validation losses, and their ratio."
    from distcourse.train import Config
    ours, summary = trainer_curve(b, steps, every, Path(tmp, "ttl_distcourse"), compile)
    theirs = hf_curve(b, steps, every, Path(tmp, "ttl_hf"), Config.warmup_steps)
    target = max(ours[-1][2], theirs[-1][2])
    (t_ours, s_ours), (t_theirs, s_theirs) = crossing(ours, target), crossing(theirs, target)
    out = {"target_loss": target, "steps": steps, "eval_every": every, "shape": [b.batch_size, b.seq_len],
           "distcourse": {"seconds": t_ours, "step": s_ours, "curve": ours, "choices": summary["choices"]},
           "hf_trainer": {"seconds": t_theirs, "step": s_theirs, "curve": theirs},
           "ratio": t_theirs / t_ours if t_ours else None, "steps_ratio": s_theirs / s_ours if s_ours else None}
    if per_step_ratio and s_ours:  # steps to the loss x the paired per-step speed: what load moves least
        out["paired_estimate"] = out["steps_ratio"] * per_step_ratio
    return out


if __name__ == "__main__":  # the per-round rates of a results.json's paired ratios
    import sys
    res = json.loads(Path(sys.argv[1]).read_text())
    for k, v in res.get("paired", {}).items(): print(summary_line(k, v))
