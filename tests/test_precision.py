"Mixed precision: bf16 saves activation memory, fp16 without a GPU is refused, a bf16 CLI run is recorded as bf16."
import json
import math

import pytest
import torch

from conftest import PY, ROOT, run_cli
from distcourse.model import build_model
from distcourse.precision_choice import activation_bytes, op_dtypes


@pytest.mark.fast
def test_bf16_saves_activation_memory():
    torch.manual_seed(0)
    model = build_model("tiny", "clm", vocab_size=8192)
    ids = torch.randint(0, 8192, (4, 64))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    fp32 = activation_bytes(model, batch, "clm")
    bf16 = activation_bytes(model, batch, "clm", torch.bfloat16)
    logits = 4 * 63 * 8192 * 4  # the fp32 log-softmax the loss saves in both runs
    assert logits < bf16 < fp32, (fp32, bf16)


@pytest.mark.fast
def test_op_dtypes_sees_autocast():
    lin = torch.nn.Linear(8, 8)
    with op_dtypes() as counts, torch.autocast("cpu", dtype=torch.bfloat16):
        lin(torch.randn(2, 8))
    with op_dtypes() as plain:
        lin(torch.randn(2, 8))
    assert counts == {("linear", "bf16"): 1} and plain == {("linear", "fp32"): 1}


@pytest.mark.fast
@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is allowed where there is a CUDA GPU")
def test_fp16_without_gpu_is_refused(tmp_path, capsys):
    from distcourse.train import main
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny", "--mixed_precision", "fp16", "--output_dir", str(out)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert err == ("distcourse.train: error: --mixed_precision fp16 needs a CUDA GPU "
                   "(on CPU Accelerate silently runs fp32); use bf16 or no"), err
    assert not out.exists()


def test_bf16_cli_run_records_bf16(tmp_path):
    out = tmp_path / "bf16"
    proc = run_cli([PY, "-m", "distcourse.train", "--config", str(ROOT / "configs/tiny.yaml"),
                    "--mixed_precision", "bf16", "--max_steps", "3", "--log_every", "1", "--eval_every", "0",
                    "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert run["mixed_precision"] == "bf16" and run["config"]["mixed_precision"] == "bf16"
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    losses = [r["loss"] for r in recs if "split" not in r]
    assert len(losses) == 3 and all(math.isfinite(l) for l in losses), losses
    assert math.isfinite(run["final"]["loss"])
