"build_model / check_compat / GPT: forward passes on real batches, save-load round trips, pad tokens, errors."
import copy
import math

import pytest
import torch
import torch.nn as nn
import transformers

from distcourse.data import get_tokenizer
from distcourse.loaders import get_dataloaders
from distcourse.gpt import GPT, GPTConfig
from distcourse.model import PRESETS, build_model, check_compat, num_params

pytestmark = pytest.mark.fast  # every test here is quick: in the fast tier

PAIRS = [("clm", "gpt2"), ("mlm", "bert"), ("cls", "bert"), ("cls", "gpt2")]  # every (task, arch) there is


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer("stdlib")


@pytest.fixture(scope="module")
def batches(tok):
    "One real collated training batch per task: B=4, at most 32 tokens."
    out = {}
    for task in ("clm", "mlm", "cls"):
        train_dl, _ = get_dataloaders(task, tok, seq_len=32, batch_size=4, max_examples=400)
        out[task] = next(iter(train_dl))
    out["num_labels"] = train_dl.dataset.features["labels"].num_classes
    return out


@pytest.mark.parametrize("task,arch", PAIRS)
def test_forward_shapes_and_initial_loss(tok, batches, task, arch):
    n_labels = batches["num_labels"]
    model = build_model("tiny", task, tokenizer=tok, num_labels=n_labels, arch=arch)
    assert type(model) is type(build_model("tiny", task, tokenizer=tok, num_labels=n_labels, arch=arch))
    assert model.config._attn_implementation == "sdpa" and model.config.vocab_size == len(tok)
    batch = batches[task]
    out = model(**batch)
    B, T = batch["input_ids"].shape
    assert out.logits.shape == ((B, n_labels) if task == "cls" else (B, T, len(tok)))
    assert torch.isfinite(out.loss)
    # a fresh model guesses uniformly: the loss is close to ln(number of outputs)
    assert abs(out.loss.item() - math.log(n_labels if task == "cls" else len(tok))) < 0.5


@pytest.mark.parametrize("task", ["clm", "mlm", "cls"])
def test_save_pretrained_round_trip(tok, batches, tmp_path, task):
    model = build_model("tiny", task, tokenizer=tok, num_labels=batches["num_labels"]).eval()
    model.save_pretrained(tmp_path)
    batch = {k: v for k, v in batches[task].items() if k != "labels"}
    for back in (build_model(str(tmp_path), task), build_model(tmp_path, task, num_labels=batches["num_labels"])):
        assert type(back) is type(model)
        assert torch.equal(back.eval()(**batch).logits, model(**batch).logits)


def test_presets_sizes_and_dropout(tok):
    with torch.device("meta"):  # sizes only: nothing is allocated
        for task, arch in PAIRS:
            sizes = {name: build_model(name, task, tokenizer=tok, num_labels=9, arch=arch) for name in PRESETS}
            assert num_params(sizes["tiny"]) < 1_000_000 and 5e6 <= num_params(sizes["small"]) <= 20e6
            for name, model in sizes.items():
                drops = [m.p for m in model.modules() if isinstance(m, nn.Dropout)]
                drops += [getattr(model.config, k) for k in ("attn_pdrop", "attention_probs_dropout_prob")
                          if hasattr(model.config, k)]  # sdpa's attention dropout is a number, not a module
                assert (max(drops) == 0.0) == (name != "base"), (name, task, arch, drops)
        assert num_params(build_model("base", "clm", vocab_size=50257)) == 124_439_808


def test_gpt2_classifier_gets_a_pad_token(tok):
    gpt2_like = copy.deepcopy(tok)
    gpt2_like.pad_token = None  # GPT-2's tokenizer has no pad token
    model = build_model("tiny", "cls", tokenizer=gpt2_like, num_labels=3, arch="gpt2").eval()
    assert gpt2_like.pad_token == gpt2_like.eos_token
    assert model.config.pad_token_id == gpt2_like.eos_token_id is not None
    texts = ["Return the sum.", "Open a file and return a stream; raise OSError on failure."]
    padded = model(**gpt2_like(texts, padding=True, return_tensors="pt")).logits  # (2, 3)
    alone = model(**gpt2_like(texts[:1], return_tensors="pt")).logits  # (1, 3)
    torch.testing.assert_close(padded[:1], alone, atol=1e-5, rtol=1e-5)


def test_check_compat(tok):
    model = build_model("tiny", "clm", tokenizer=tok)
    check_compat(model, tok, seq_len=256)
    with pytest.raises(ValueError, match=r"seq_len=2048 exceeds the model's 256 positions; pass --seq_len 256 or a larger model"):
        check_compat(model, tok, seq_len=2048)
    with pytest.raises(ValueError, match=r"tokenizer has 8192 tokens but the model's vocabulary has 5000.*build the model with this tokenizer"):
        check_compat(build_model("tiny", "clm", vocab_size=5000), tok)
    bert = build_model("tiny", "mlm", tokenizer=tok)
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        check_compat(bert, seq_len=257)


def test_unknown_names_fail_fast_offline(tok, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    def no_download(*args, **kwargs): raise AssertionError("from_pretrained was called with the Hub offline")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_download)
    with pytest.raises(ValueError, match=r"unknown model 'medium'.*not a preset \(tiny, small, base\)"):
        build_model("medium", tokenizer=tok)
    with pytest.raises(ValueError, match="did you mean 'small'"):
        build_model("smal", tokenizer=tok)
    with pytest.raises(ValueError, match=r"'gpt2'.*the Hub is offline \(HF_HUB_OFFLINE=1\)"):
        build_model("gpt2", tokenizer=tok)
    with pytest.raises(ValueError, match="no such directory"):
        build_model("./runs/missing/model")


def test_hub_failure_is_a_value_error_with_advice(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    def missing(*args, **kwargs): raise OSError("someone/nothing is not a valid model identifier\nmore")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", missing)
    with pytest.raises(ValueError, match=r"not a preset \(tiny, small, base\).*from_pretrained failed \(someone/nothing is not"):
        build_model("someone/nothing")


@pytest.mark.parametrize("kwargs,message", [
    (dict(task="seq2seq"), r"task='seq2seq': choose one of clm, mlm, cls"),
    (dict(task="cls"), "needs num_labels"),
    (dict(task="clm", arch="bert"), "arch='bert' has no clm model; use arch='gpt2'"),
    (dict(task="mlm", arch="gpt2"), "arch='gpt2' has no mlm model; use arch='bert'"),
    (dict(arch="llama"), "arch='llama': choose one of gpt2, bert"),
])
def test_bad_arguments(tok, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_model("tiny", tokenizer=tok, **kwargs)


def test_preset_needs_a_vocabulary(tok):
    with pytest.raises(ValueError, match="pass tokenizer="):
        build_model("tiny", "clm")
    with pytest.raises(ValueError, match="smaller than the tokenizer's 8192 tokens"):
        build_model("tiny", "clm", tokenizer=tok, vocab_size=100)
    assert build_model("tiny", "clm", tokenizer=tok, vocab_size=8256).config.vocab_size == 8256  # round up is fine


def test_gpt_from_scratch(batches):
    cfg = GPTConfig(vocab_size=8192, **{k: PRESETS["tiny"][k] for k in ("n_positions", "n_layer", "n_head", "n_embd")})
    gpt = GPT(cfg)
    ids = batches["clm"]["input_ids"]  # (B, T)
    logits, loss = gpt(ids[:, :-1], targets=ids[:, 1:])
    assert logits.shape == (*ids[:, :-1].shape, 8192) and abs(loss.item() - math.log(8192)) < 0.5
    assert gpt(ids)[1] is None
    assert gpt.lm_head.weight is gpt.transformer.wte.weight  # tied
    assert num_params(gpt) == num_params(build_model("tiny", "clm", vocab_size=8192))
    with pytest.raises(ValueError, match="seq_len=257 exceeds the model's 256 positions"):
        gpt(torch.zeros(1, 257, dtype=torch.long))
