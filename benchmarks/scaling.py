"""Scaling efficiency as the field defines it, from measured numbers; each result states its batch and hardware.

- weak scaling: the batch *per device* fixed, N times the devices: tokens/s_N ÷ (N × tokens/s_1);
- strong scaling: the *global* batch fixed, N times the devices: T_1 ÷ (N × T_N), T the seconds per step.

Ideal is 1.0 for both. Either needs N times the hardware: N GPUs against 1, or N processes on a core each against
1 process on one core. N processes sharing the cores of 1 measure something else: `processes_vs_threads`.
Imports nothing heavy (tests/test_benchmarks.py checks the formulas on constructed numbers).
"""
from dataclasses import dataclass


@dataclass
class Run:
    "One measured run: how many devices, what each one holds per step, and how fast it went."
    devices: int            # GPUs, or cores with one process each: the hardware the run had
    batch_per_device: int   # sequences per optimizer step on each device
    tokens_per_s: float     # the whole run's throughput (all devices together)
    step_s: float           # seconds per optimizer step
    device: str = "core"    # what a device is: "core", "GPU"

    @property
    def global_batch(self) -> int: return self.devices * self.batch_per_device


def _check(one: Run, many: Run):
    if one.devices != 1: raise ValueError(f"the baseline ran on {one.devices} {one.device}s; pass a 1-device run")
    if many.devices < 2: raise ValueError(f"the scaled run has {many.devices} {many.device}; it needs N >= 2")
    if one.device != many.device: raise ValueError(f"a {one.device} against a {many.device}: compare like devices")


def weak_scaling_efficiency(one: Run, many: Run) -> dict:
    "tokens/s_N ÷ (N × tokens/s_1) at a fixed per-device batch, N times the devices; with what was compared."
    _check(one, many)
    if one.batch_per_device != many.batch_per_device:
        raise ValueError(f"weak scaling keeps the batch per device: {one.batch_per_device} vs "
                         f"{many.batch_per_device}; for a fixed global batch use strong_scaling_efficiency")
    n = many.devices
    return {"value": many.tokens_per_s / (n * one.tokens_per_s), "n": n,
            "what": f"weak scaling: {n} {many.device}s vs 1, batch {one.batch_per_device} per {one.device} "
                    f"(global {one.global_batch} vs {many.global_batch}); tokens/s_{n} ÷ ({n} × tokens/s_1)"}


def strong_scaling_efficiency(one: Run, many: Run) -> dict:
    "T_1 ÷ (N × T_N), seconds per step at a fixed global batch, N times the devices; with what was compared."
    _check(one, many)
    if one.global_batch != many.global_batch:
        raise ValueError(f"strong scaling keeps the global batch: {one.global_batch} vs {many.global_batch}; "
                         "for a fixed batch per device use weak_scaling_efficiency")
    n = many.devices
    return {"value": one.step_s / (n * many.step_s), "n": n,
            "what": f"strong scaling: {n} {many.device}s vs 1, global batch {one.global_batch} "
                    f"({many.batch_per_device} per {many.device} on {n}); T_1 ÷ ({n} × T_{n})"}
