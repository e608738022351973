"The data pipeline on local files shaped like Hub datasets, bad inputs, and the sampler's order."
import csv
import json
import socket

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler

from distcourse.data import get_tokenizer, load_corpus
from distcourse.loaders import EpochSampler, get_collator, get_dataloaders, prepare_cls, split_dataset

pytestmark = pytest.mark.fast  # every test here is quick: in the fast tier

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def sentence(i, label):
    "A short deterministic sentence whose words depend on its label."
    return " ".join(WORDS[(label * 3 + k * i) % len(WORDS)] for k in range(3 + i % 5)) + f" number {i}"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    "A fresh cache directory for this test."
    monkeypatch.setenv("DISTCOURSE_DATA", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def files(tmp_path):
    "emotion-like JSON and JSONL files (6 classes), an ag_news-like CSV (4 classes) and a .txt file."
    emotion = [{"text": sentence(i, i % 6), "label": i % 6} for i in range(120)]
    (tmp_path / "emotion.jsonl").write_text("\n".join(json.dumps(r) for r in emotion) + "\n")
    (tmp_path / "emotion.json").write_text(json.dumps(emotion))
    with open(tmp_path / "ag_news.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows([sentence(i, i % 4), i % 4] for i in range(80))
    (tmp_path / "lines.txt").write_text("\n".join(sentence(i, 0) for i in range(200)) + "\n\n")
    return tmp_path


@pytest.fixture
def tok(files, cache):
    "A small byte-level BPE tokenizer trained on the .txt file."
    return get_tokenizer(str(files / "lines.txt"), vocab_size=300)


def test_tokenizer_is_cached_and_specials(files, cache, tok):
    assert len(tok) == 300 and (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (0, 1, 3)
    (saved,) = [p for p in (cache / "tokenizers").iterdir() if p.suffix != ".lock"]
    assert saved.name.startswith("lines-") and saved.name.endswith("-300")
    again = get_tokenizer(str(files / "lines.txt"), vocab_size=300)
    assert again.get_vocab() == tok.get_vocab() and len(list((cache / "tokenizers").glob("*-300"))) == 1


@pytest.mark.parametrize("name,n_classes", [("emotion.jsonl", 6), ("emotion.json", 6), ("ag_news.csv", 4)])
def test_cls_pipeline(files, tok, name, n_classes):
    ds = load_corpus(str(files / name))
    assert ds.column_names == ["text", "label"]
    splits = split_dataset(ds, val_frac=0.2, seed=0, stratify_column="label")
    val_labels = sorted(splits["validation"]["label"])
    assert val_labels == sorted(list(range(n_classes)) * (len(splits["validation"]) // n_classes))  # stratified
    assert len(splits["validation"]) == len(ds) // 5 and len(splits["train"]) == len(ds) - len(ds) // 5
    prepared = prepare_cls(splits["train"], tok, seq_len=16)
    assert prepared.column_names == ["input_ids", "attention_mask", "labels"]
    batch = get_collator("cls", tok)([prepared[i] for i in range(8)])
    longest = max(len(prepared[i]["input_ids"]) for i in range(8))
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (8, longest) and longest <= 16
    assert batch["labels"].tolist() == list(prepared["labels"][:8])
    assert set(batch["labels"].tolist()) <= set(range(n_classes))
    assert (batch["input_ids"][batch["attention_mask"] == 0] == tok.pad_token_id).all()


def test_get_dataloaders_cls_from_file(files, tok):
    train_dl, val_dl = get_dataloaders("cls", tok, seq_len=16, batch_size=4, dataset=str(files / "ag_news.csv"),
                                       val_frac=0.1)
    assert train_dl.dataset.features["labels"].num_classes == 4
    batch = next(iter(train_dl))
    assert batch["input_ids"].shape[0] == 4 and batch["labels"].shape == (4,)
    assert sum(len(b["labels"]) for b in val_dl) == len(val_dl.dataset) == 8


def test_string_labels_are_encoded_by_get_dataloaders(files, tok):
    rows = [{"text": sentence(i, i % 3), "label": ["joy", "anger", "fear"][i % 3]} for i in range(60)]
    (files / "named.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    ds = load_corpus(str(files / "named.jsonl"))
    with pytest.raises(ValueError, match="class_encode_column"):
        prepare_cls(ds, tok, 16)
    train_dl, _ = get_dataloaders("cls", tok, 16, 4, dataset=str(files / "named.jsonl"))
    assert train_dl.dataset.features["labels"].names == ["anger", "fear", "joy"]


def test_txt_file_for_clm(files, tok):
    ds = load_corpus(str(files / "lines.txt"))
    assert len(ds) == 201 and ds[200]["text"] == ""  # a blank line is an (empty) example ...
    train_dl, val_dl = get_dataloaders("clm", tok, seq_len=8, batch_size=2, dataset=str(files / "lines.txt"))
    batch = next(iter(train_dl))
    assert batch["input_ids"].shape == (2, 8) and torch.equal(batch["labels"], batch["input_ids"])
    ids = torch.tensor([*train_dl.dataset["input_ids"], *val_dl.dataset["input_ids"]])
    assert (ids == tok.pad_token_id).sum() == 0
    assert 0 < (ids == tok.eos_token_id).sum() <= 200  # ... that packing skips (one eos per real line)


def test_saved_dataset_directory(files, tok):
    load_corpus(str(files / "ag_news.csv")).save_to_disk(str(files / "saved"))
    assert len(load_corpus(str(files / "saved"))) == 80


def test_offline_hub_id_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError("tried to reach the network")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    with pytest.raises(ValueError, match="offline") as e:
        load_corpus("dair-ai/emotion")
    assert "'stdlib'" in str(e.value) and ".jsonl" in str(e.value)
    with pytest.raises(ValueError, match="offline") as e:
        get_tokenizer("gpt2")
    assert "'stdlib'" in str(e.value)
    with pytest.raises(ValueError, match="offline"):
        get_dataloaders("cls", None, 16, 4, dataset="ag_news")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(str(tmp_path / "nope.csv"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_tokenizer(str(tmp_path / "no_tokenizer_dir/x"))


def test_missing_columns(files, tok):
    with pytest.raises(ValueError, match=r"its columns are \['text', 'label'\].*text_column"):
        load_corpus(str(files / "ag_news.csv"), text_column="description")
    with pytest.raises(ValueError, match=r"label column 'topic'.*--label_column"):
        get_dataloaders("cls", tok, 16, 4, dataset=str(files / "ag_news.csv"), label_column="topic")


def test_bad_task_and_batch_size(tok):
    with pytest.raises(ValueError, match="clm, mlm, cls"):
        get_collator("seq2seq", tok)
    with pytest.raises(ValueError, match="clm, mlm, cls"):
        get_dataloaders("seq2seq", tok, 16, 4)
    with pytest.raises(ValueError, match="batch_size=0"):
        get_dataloaders("clm", tok, 16, 0)


def test_epoch_sampler_depends_only_on_seed_and_epoch():
    a, b = EpochSampler(50, seed=3), EpochSampler(list(range(50)), seed=3)
    assert list(a) == list(b) and sorted(a) == list(range(50)) and len(a) == 50
    assert list(EpochSampler(50, seed=4)) != list(a)
    b.set_epoch(1)
    assert list(b) != list(a)
    a.set_epoch(1)
    assert list(a) == list(b)
    assert not hasattr(a, "generator")  # Accelerate would re-seed an attribute of that name
    one = list(BatchSampler(EpochSampler(50, seed=3), 6, drop_last=True))
    shards = [list(BatchSamplerShard(BatchSampler(EpochSampler(50, seed=3), 3, drop_last=True), 2, r)) for r in (0, 1)]
    assert [x + y for x, y in zip(*shards)] == one  # 2 processes x 3 = 1 process x 6, step by step
