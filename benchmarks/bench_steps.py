"""The contenders `run.py` times: one optimizer step of the same model on the same data, written three ways,
and a large matmul (the measured rate that `mm_utilisation` divides by; MFU uses the datasheet's).

Every contender builds its model with `torch.manual_seed(seed)` from the same preset and tokenizer, reads the
same packed blocks, and does the same math: forward, token-mean cross-entropy, backward, clip the gradient
norm to 1, AdamW (lr 2e-3, betas (0.9, 0.95), weight decay 0.1 on matrices only), warmup + cosine schedule.
"""
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments, get_cosine_schedule_with_warmup
from transformers.trainer_callback import PrinterCallback

from distcourse.data import get_tokenizer
from distcourse.loaders import get_dataloaders
from distcourse.ddp import train_step
from distcourse.loop import epochs, loss_sum, make_optimizer, make_scheduler
from distcourse.model import build_model

LR, BETAS, WEIGHT_DECAY, WARMUP_STEPS, MAX_GRAD_NORM = 2e-3, (0.9, 0.95), 0.1, 10, 1.0


@dataclass
class Bench:
    "What one measurement trains: the same for every contender."
    model: str = "small"          # a preset of `build_model`
    batch_size: int = 8           # sequences per optimizer step (in all, over all processes)
    seq_len: int = 128            # tokens per sequence
    precision: str = "fp32"       # fp32, or bf16 (autocast, fp32 master weights)
    compile: bool = False         # torch.compile the model of every contender
    vocab_size: int | None = None # None: the tokenizer's (8192); 50304 gives GPT-2 124M's shape with --model base
    device: str = "cpu"
    warmup: int = 2               # untimed steps of each contender first
    steps: int = 10               # timed steps of each contender
    chunk: int = 1                # steps per turn: contenders take turns every `chunk` steps
    seed: int = 0

    @property
    def total_steps(self): return (self.warmup + self.steps) * self.chunk


def sync(device):
    "Wait for the device to finish its queued work (a no-op on CPU)."
    if str(device).startswith("cuda"): torch.cuda.synchronize()


def build(b: Bench):
    "The seeded model (on the CPU) and the training loader that every contender starts from."
    tok = get_tokenizer("stdlib")
    train_dl, _ = get_dataloaders("clm", tok, b.seq_len, b.batch_size, seed=b.seed)
    torch.manual_seed(b.seed)  # identical initial weights for every contender
    model = build_model(b.model, "clm", tokenizer=tok, vocab_size=b.vocab_size)
    return model.train(), train_dl


class TorchLoop:
    "The reference: a minimal hand-written loop over the model's own loss (`model(**batch).loss`), config as built."
    name = "torch"

    def __init__(self, b: Bench):
        model, dl = build(b)
        self.model, self.device, self.batches = model.to(b.device), b.device, epochs(dl)
        self.forward = torch.compile(self.model) if b.compile else self.model
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
                                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                     lr=LR, betas=BETAS)
        self.sched = get_cosine_schedule_with_warmup(self.opt, WARMUP_STEPS, b.total_steps)
        self.dtype = torch.bfloat16 if b.precision == "bf16" else None

    def step(self) -> int:
        batch = {k: v.to(self.device, non_blocking=True) for k, v in next(self.batches).items()}
        with torch.autocast(torch.device(self.device).type, self.dtype) if self.dtype else nullcontext():
            loss = self.forward(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)
        self.opt.step(); self.sched.step(); self.opt.zero_grad(set_to_none=True)
        return batch["input_ids"].numel()


class DistcourseStep:
    "The course's trainer: `train_step` on a model, optimizer and loader prepared by `make_accelerator`."
    name = "distcourse"

    def __init__(self, b: Bench, accelerator):
        model, dl = build(b)
        self.loss_fn = torch.compile(loss_sum) if b.compile else loss_sum  # as the trainer compiles: model and loss
        opt = make_optimizer(model, LR, WEIGHT_DECAY, BETAS)
        self.sched = make_scheduler(opt, WARMUP_STEPS, b.total_steps)
        self.acc = accelerator
        self.model, self.opt, dl = accelerator.prepare(model, opt, dl)
        self.batches = epochs(dl)

    def step(self) -> int:
        batch = next(self.batches)
        train_step(self.acc, self.model, self.opt, self.sched, [batch], "clm", MAX_GRAD_NORM, self.loss_fn)
        return batch["input_ids"].numel() * self.acc.num_processes  # every process's batch has this shape


class Matmul:
    "`reps` square matmuls of size `n` in `dtype`: the FLOP/s this machine reaches (what `mm_utilisation` divides by)."
    name = "matmul"

    def __init__(self, device, dtype, n, reps=1):
        g = torch.Generator(device="cpu").manual_seed(0)
        self.a, self.b = (torch.randn(n, n, generator=g).to(device, dtype) for _ in range(2))
        self.n, self.reps, self.dtype = n, reps, dtype

    def step(self) -> float:
        for _ in range(self.reps): torch.mm(self.a, self.b)
        return 2 * self.n ** 3 * self.reps  # FLOPs: n² outputs, n multiply-adds each


def timed(contender, n, device) -> tuple:
    "(seconds per step, work per step) of `n` steps of `contender`, the device drained before and after."
    sync(device); t0 = time.perf_counter()
    work = sum(contender.step() for _ in range(n))
    sync(device)
    return (time.perf_counter() - t0) / n, work / n


class _TakeTurns(TrainerCallback):
    "Every `chunk` Trainer steps: time the Trainer's chunk, then let each other contender run (and time) its chunk."
    def __init__(self, others, b: Bench, record, tokens_per_step):
        self.others, self.b, self.record, self.tokens, self.turn = others, b, record, tokens_per_step, 0

    def on_train_begin(self, args, state, control, **kw):
        sync(self.b.device); self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        if state.global_step % self.b.chunk: return
        sync(self.b.device)  # everything since the Trainer got the turn back: data, step, its bookkeeping, callbacks
        self.record("hf_trainer", (time.perf_counter() - self.t0) / self.b.chunk, self.tokens)
        take_turns(self.others, self.b, self.record, self.turn); self.turn += 1
        sync(self.b.device); self.t0 = time.perf_counter()


def take_turns(contenders, b, record, turn):
    "One turn: each contender runs `b.chunk` steps; the order flips every turn, so nobody always follows the same one."
    for c in (contenders if turn % 2 == 0 else contenders[::-1]):
        record(c.name, *timed(c, b.chunk, b.device))


def make_hf_trainer(b: Bench, out_dir, callbacks, max_steps=None, warmup_steps=WARMUP_STEPS) -> Trainer:
    "`transformers.Trainer` on `b`'s model and data, the optimizer and schedule the others use."
    model, dl = build(b)
    args = TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=b.batch_size, max_steps=max_steps or b.total_steps,
        learning_rate=LR, weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
        max_grad_norm=MAX_GRAD_NORM, lr_scheduler_type="cosine", warmup_steps=warmup_steps,
        optim="adamw_torch",  # torch.optim.AdamW, as the other two (its default would be the fused kernel)
        bf16=b.precision == "bf16", torch_compile=b.compile, use_cpu=b.device == "cpu", seed=b.seed,
        report_to="none", save_strategy="no", eval_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, dataloader_pin_memory=b.device != "cpu",
        dataloader_drop_last=True)  # every step a full batch, as the other two loaders
    trainer = Trainer(model=model, args=args, train_dataset=dl.dataset, data_collator=dl.collate_fn,
                      callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # it would print the end-of-training summary
    return trainer


def hf_trainer(b: Bench, others, record, out_dir):
    "`transformers.Trainer` on the same model and data; `others` take turns with it from a callback."
    make_hf_trainer(b, out_dir, [_TakeTurns(others, b, record, b.batch_size * b.seq_len)]).train()
