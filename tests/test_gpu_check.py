"""benchmarks/gpu_check.py, the one-command check for the first person with GPUs: its comparison rejects what a
wrong reduction gives, its layouts keep the global batch, the trainer's own validation decides what it skips, and it
runs end to end on 2 CPU processes (gloo) as it would on GPUs (NCCL)."""
import importlib.util
import json

import pytest
import torch

from conftest import PY, ROOT, run_cli

_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gc)


def fake_result(scale=1.0, loss_shift=0.0) -> dict:
    "Three steps and step-1 gradients, every gradient (and so its norm) multiplied by `scale`."
    torch.manual_seed(0)
    grads = {"wte": torch.randn(8, 4) * scale, "h.0.attn": torch.randn(4, 4) * scale}
    recs = [{"step": s, "loss": 5.0 - s + loss_shift, "grad_norm": 2.0 * scale} for s in (1, 2, 3)]
    return {"records": recs, "grads": grads}


@pytest.mark.fast
def test_compare_rejects_a_gradient_off_by_a_constant():
    "Summing instead of averaging over 2 ranks doubles every gradient, and leaves the loss as it was."
    assert gc.compare(fake_result(), fake_result(), 1e-5)["verdict"] == "equal"
    doubled = gc.compare(fake_result(), fake_result(scale=2.0), 1e-5)
    assert doubled["verdict"] == "DIFFER" and doubled["loss"] == 0 and doubled["grad_norm"] == pytest.approx(1.0)
    assert gc.compare(fake_result(), fake_result(loss_shift=1e-3), 1e-5)["verdict"] == "DIFFER"
    fewer = {**fake_result(), "records": fake_result()["records"][:2]}
    assert gc.compare(fake_result(), fewer, 1e-5)["verdict"].startswith("DIFFER: steps")


@pytest.mark.fast
def test_compare_finds_a_small_tensor_wrong_under_a_large_one():
    "A bias 1e-6 the size of the largest gradient, doubled: 1e-6 of the whole norm, 100% of its own."
    want = fake_result()
    want["grads"]["ln.bias"] = want["grads"]["wte"][0, :4] * 1e-6
    got = {**want, "grads": {**want["grads"], "ln.bias": want["grads"]["ln.bias"] * 2}}
    res = gc.compare(want, got, 1e-5)
    assert res["verdict"] == "DIFFER" and res["grads"] == pytest.approx(1.0), res


@pytest.mark.fast
@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_layout_trains_the_same_global_batch(world):
    for name, flags in gc.layouts(world).items():
        args = gc.batch_flags(world, flags)
        batch, accum = int(args[1]), int(args[3])
        dp = world // (flags.get("tp", 1) * flags.get("pp", 1) * flags.get("cp", 1))
        assert batch * accum * dp == gc.GLOBAL and accum >= flags.get("pp", 1), (world, name, args)


@pytest.mark.fast
def test_what_the_trainer_refuses_is_listed_not_run(tmp_path):
    "tp 8 splits the `small` model's 4 heads unevenly: the trainer's own validate says so."
    why = gc.refusal(8, gc.argv(8, {"tp": 8}, "small", tmp_path / "tp8"))
    assert why and "head" in why, why
    assert gc.refusal(8, gc.argv(8, {"tp": 4}, "small", tmp_path / "tp4")) is None


def test_runs_end_to_end_on_two_cpu_processes(tmp_path):
    proc = run_cli([PY, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--only", "dp", "--out",
                    str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert row["layout"] == "dp" and row["verdict"] == "equal" and row["grad_norm"] <= 1e-5, row
    assert "| dp | 2 |" in (tmp_path / "gpu_check.md").read_text()
