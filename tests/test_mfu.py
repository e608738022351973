"MFU as PaLM defines it: FLOPs of the tokens every forward processes (clm, mlm, cls), over the card's datasheet peak."
import pytest
import torch

from distcourse.data import get_tokenizer
from distcourse.gpt import flops_per_token
from distcourse.launch import make_accelerator
from distcourse.loaders import get_dataloaders
from distcourse.loop import count_targets
from distcourse.model import build_model
from distcourse.tracking import DATASHEET_FLOPS, Meter, datasheet_gpu

pytestmark = pytest.mark.fast  # every test here is quick: in the fast tier

CARDS = {"NVIDIA H100 80GB HBM3": "H100 SXM", "NVIDIA H100 PCIe": "H100 PCIe", "NVIDIA H100 NVL": "H100 NVL",
         "NVIDIA H200": "H200 SXM", "NVIDIA H200 NVL": "H200 NVL", "NVIDIA A100-SXM4-80GB": "A100 SXM4 80GB",
         "NVIDIA A100-SXM4-40GB": "A100 SXM4 40GB", "NVIDIA A100-PCIE-40GB": "A100 PCIe 40GB",
         "NVIDIA A100 80GB PCIe": "A100 PCIe 80GB", "NVIDIA H100 80GB HBM3 MIG 3g.40gb": None,
         "NVIDIA GH200 480GB": None, "Tesla V100-SXM2-16GB": None, "": None}


@pytest.mark.parametrize("name", CARDS)
def test_datasheet_card(name):
    "Each device name (torch.cuda.get_device_name) reads as its own card: SXM, PCIe and NVL are different peaks."
    assert datasheet_gpu(name) == CARDS[name]


def test_datasheet_dense_peaks():
    "Dense bf16 and fp32 (no TF32) peaks, not the 2:4-sparse figures the datasheets print first."
    bf16 = {card: DATASHEET_FLOPS[card]["bf16"] / 1e12 for card in ("H100 SXM", "H100 PCIe", "H200 SXM")}
    assert bf16 == {"H100 SXM": 989.4, "H100 PCIe": 756, "H200 SXM": 989.4}
    assert {DATASHEET_FLOPS[c]["bf16"] for c in DATASHEET_FLOPS if c.startswith("A100")} == {312e12}
    assert DATASHEET_FLOPS["H100 PCIe"]["no"] == 51.2e12 and DATASHEET_FLOPS["A100 PCIe 80GB"]["no"] == 19.5e12


@pytest.fixture(scope="module")
def acc():
    return make_accelerator()  # one process, CPU: the peak is a measured matmul rate


@pytest.mark.parametrize("task", ["clm", "mlm", "cls"])
def test_meter_counts_processed_tokens(acc, task):
    "The meter's tokens are every non-padding input token, not the loss's targets, and its FLOPs PaLM's per sequence."
    tok = get_tokenizer("stdlib")
    train_dl, _ = get_dataloaders(task, tok, 64, 8, max_examples=200)
    model = build_model("tiny", task, tokenizer=tok, num_labels=2 if task == "cls" else None)
    batches = [b for b, _ in zip(train_dl, range(2))]
    meter = Meter(acc, model, 64)

    def steps():  # as train_steps draws them: the batches through `counted`, results counting the targets
        drawn = meter.counted(iter(batches))
        for step in (1, 2):
            batch = next(drawn)
            yield step, {"tokens": int(count_targets(batch, task)), "loss": 0.0}

    for _ in meter.timed(steps()): pass
    lens = [int(row.sum()) for b in batches for row in b.get("attention_mask", torch.ones_like(b["input_ids"]))]
    targets = sum(int(count_targets(b, task)) for b in batches)
    tokens, squares = meter.seen.tolist()
    print(f"{task}: {tokens} tokens processed, {targets} targets")
    assert tokens == sum(lens) > targets  # clm: 64 a row (63 targets); mlm: ~15% of them; cls: one a row
    if task == "cls": assert sum(lens) < sum(b["input_ids"].numel() for b in batches)  # padding not counted
    else: assert sum(lens) == sum(b["input_ids"].numel() for b in batches)  # clm and mlm: packed, no padding
    want = sum(n * flops_per_token(model, n) for n in lens)  # PaLM's 6N + 12·L·H·Q·T, T = each sequence's length
    assert meter.flops(tokens, squares) == pytest.approx(want, rel=1e-12)
    rec = meter.stats()  # both numbers over the same seconds: their ratio is FLOPs per token over the peak
    assert "mfu" not in rec and rec["mm_utilisation"] / rec["tokens_per_s"] == pytest.approx(
        want / sum(lens) / meter.all_peak, rel=1e-9)
    assert meter.total == sum(lens) and meter.seen.tolist() == [0, 0]
