"Distributed evaluation on real processes (2 gloo ranks against 1), and the offline metrics against hand computations."
import json
import math

import pytest
import torch

from conftest import ACCELERATE, free_port, run_cli
from distcourse.checkpoint import DataStream
from distcourse.data import get_tokenizer
from distcourse.evaluation import F1, Accuracy, Perplexity, confusion_matrix, eval_worker
from distcourse.launch import launch
from distcourse.loaders import get_dataloaders
from distcourse.loop import summarize

BATCH = 8  # per process; the validation sets below (cls 20, clm 54 examples) are not multiples of 2 × 8
TASKS = ("cls", "clm")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    "`eval_worker` on 1 process (in this one) and on 2 real processes, for each task, same seeded model."
    out = tmp_path_factory.mktemp("eval")
    for task in TASKS:
        for world in (1, 2): launch(eval_worker, (str(out), task, BATCH, 32, 400), num_processes=world)
    return {(t, w): torch.load(out / f"{t}-{w}.pt") for t in TASKS for w in (1, 2)}


@pytest.mark.parametrize("task", TASKS)
def test_plain_gather_repeats_examples(results, task):
    one, two = results[task, 1], results[task, 2]
    n = one["val_size"]
    assert n % (2 * BATCH) != 0, "the validation set must not split evenly for this test to mean anything"
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert len(one["plain"]["loss"]) == n               # one process: nothing padded
    assert len(two["plain"]["loss"]) - n > 0            # two: the padded last batches come back as repeats
    assert len(two["exact"]["loss"]) == n               # gather_for_metrics: each example once


@pytest.mark.parametrize("task", TASKS)
def test_two_processes_equal_one(results, task):
    one, two = results[task, 1]["metrics"], results[task, 2]["metrics"]
    n = results[task, 1]["val_size"]
    assert one["samples"] == two["samples"] == n
    assert abs(one["loss"] - two["loss"]) <= 1e-6
    if task == "cls":
        assert one["accuracy"] == two["accuracy"] and one["macro_f1"] == two["macro_f1"]  # exactly
    else:
        assert abs(one["perplexity"] - two["perplexity"]) <= 1e-6 * one["perplexity"]
    # evaluate_distributed against the per-example stats gathered in the same run, added up by hand
    exact = results[task, 2]["exact"]
    by_hand = sum(float(x) for x in exact["loss"]) / sum(int(c) for c in exact["count"])  # per token
    assert two["loss"] == pytest.approx(by_hand, rel=1e-9)
    if task == "cls": assert two["accuracy"] == sum(int(c) for c in exact["correct"]) / n
    # each example's loss from 2 processes, in the same order, is one process's (a sum could hide a lost example)
    ex1, ex2 = results[task, 1]["exact"], results[task, 2]["exact"]
    assert len(ex2["loss"]) == len(ex1["loss"]) == n
    assert torch.allclose(ex2["loss"], ex1["loss"], rtol=0, atol=1e-5)


def test_plain_gather_gives_wrong_counts(results):
    "What a loop using `gather` would report: more samples than the validation set holds."
    two = results["clm", 2]
    assert summarize(two["plain"], "clm")["samples"] > two["val_size"]


@pytest.mark.fast
def test_accuracy_by_hand():
    preds, refs = [0, 0, 1, 1, 2, 1], [0, 1, 1, 2, 2, 3]
    assert Accuracy().compute(predictions=preds, references=refs)["accuracy"] == 3 / 6


@pytest.mark.fast
def test_macro_f1_by_hand_with_a_class_never_predicted():
    preds, refs = [0, 0, 1, 1, 2, 1], [0, 1, 1, 2, 2, 3]  # class 3 is in the references only
    f1 = F1().compute(predictions=preds, references=refs)["f1"]
    assert f1 == pytest.approx((2 / 3 + 2 / 5 + 2 / 3 + 0) / 4, abs=1e-12)  # 2·TP / (#predicted + #true) per class
    metric = F1()
    metric.add_batch(predictions=torch.tensor(preds[:4]), references=refs[:4])
    metric.add_batch(predictions=preds[4:], references=torch.tensor(refs[4:]))
    assert metric.compute()["f1"] == f1
    # a class predicted but absent from the references counts too (F1 0)
    assert F1().compute(predictions=[0, 1, 5], references=[0, 1, 1])["f1"] == pytest.approx((1 + 2 / 3 + 0) / 3)
    with pytest.raises(ValueError, match="only 'macro'"):
        F1().compute(predictions=preds, references=refs, average="micro")


@pytest.mark.fast
def test_perplexity_is_token_weighted():
    out = Perplexity().compute(loss=[2.0, 6.0], count=[1, 4])
    assert out["loss"] == pytest.approx(8 / 5) and out["perplexity"] == pytest.approx(math.exp(8 / 5))
    assert out["perplexity"] != pytest.approx((math.exp(2.0) + math.exp(1.5)) / 2)


@pytest.mark.fast
def test_confusion_matrix():
    cm = confusion_matrix([0, 0, 1, 2], [0, 1, 1, 2], 3)
    assert cm.tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]


def test_trainer_two_processes_counts_every_example_once(tmp_path):
    "A 2-process CLI run of the classifier: every eval record covers exactly val_size examples, with macro-F1."
    out = tmp_path / "cls"
    proc = run_cli([*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()),
                    "-m", "distcourse.train", "--task", "cls", "--model", "tiny", "--seq_len", "32",
                    "--batch_size", str(BATCH), "--max_examples", "400", "--max_steps", "4", "--eval_every", "2",
                    "--warmup_steps", "1", "--output_dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert run["world_size"] == 2 and run["val_size"] % (2 * BATCH) != 0
    evals = [r for r in map(json.loads, open(out / "metrics.jsonl")) if r.get("split") == "val"]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all(r["samples"] == run["val_size"] and "macro_f1" in r for r in evals)
    # MFU's tokens: every non-padding input token of both ranks' batches (4 steps of 2 x 8 examples), not 1 per example
    train_dl, _ = get_dataloaders("cls", get_tokenizer("stdlib"), 32, 2 * BATCH, seed=run["config"]["seed"],
                                  max_examples=400)
    stream = DataStream(train_dl, run["config"]["seed"])  # one process, the global batch: the run's order
    want = sum(int(next(stream)["attention_mask"].sum()) for _ in range(4))
    assert run["utilisation"]["tokens_processed"] == want > 4 * 2 * BATCH, (run["utilisation"], want)
