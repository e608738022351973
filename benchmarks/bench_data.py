"""The data side of `run.py`: how much of a batch is padding, and how fast text becomes training blocks."""
import statistics
import time

import torch
from datasets import Dataset
from transformers import DataCollatorWithPadding

from distcourse.data import get_tokenizer, load_corpus
from distcourse.loaders import get_collator, get_dataloaders, prepare_clm, prepare_mlm


def _pad_fraction(collate, docs, batch_size) -> float:
    "Share of padding positions in the batches `collate` makes from consecutive runs of `batch_size` documents."
    pad = total = 0
    for i in range(0, len(docs) - batch_size + 1, batch_size):
        mask = collate([{"input_ids": x} for x in docs[i:i + batch_size]])["attention_mask"]  # (B, T)
        pad, total = pad + int((mask == 0).sum()), total + mask.numel()
    return pad / total


def padding_waste(seq_len, batch_size, max_docs=None, seed=0) -> dict:
    "Pad share of fixed-length padding, dynamic padding (random batches) and packing, on the default corpus."
    tok, corpus = get_tokenizer("stdlib"), load_corpus("stdlib")
    if max_docs: corpus = corpus.select(range(min(max_docs, len(corpus))))
    docs = prepare_mlm(corpus, tok, seq_len).shuffle(seed=seed)["input_ids"]  # truncated to seq_len, unpadded
    blocks = torch.tensor(prepare_clm(corpus, tok, seq_len)["input_ids"])     # (N, seq_len)
    all_tokens = sum(len(d) for d in tok(list(corpus["text"]), add_special_tokens=False)["input_ids"])
    fixed = DataCollatorWithPadding(tok, padding="max_length", max_length=seq_len)
    return {"fixed": _pad_fraction(fixed, docs, batch_size),
            "dynamic": _pad_fraction(get_collator("cls", tok), docs, batch_size),  # each batch to its longest
            "packing": float((blocks == tok.pad_token_id).float().mean()) if blocks.shape[1] == seq_len else None,
            "truncation_drops": 1 - sum(map(len, docs)) / all_tokens,   # what fixed and dynamic padding lose
            "packing_drops": 1 - blocks.numel() / (all_tokens + len(corpus)),  # remainders (of documents + eos)
            "documents": len(corpus), "seq_len": seq_len, "batch_size": batch_size}


def data_throughput(seq_len, batch_size, repeats=3, max_docs=None) -> dict:
    "Tokens/s of tokenize + pack (`prepare_clm` on an in-memory corpus, so no cache is read), and of the loader."
    tok, corpus = get_tokenizer("stdlib"), load_corpus("stdlib")
    if max_docs: corpus = corpus.select(range(min(max_docs, len(corpus))))
    corpus = Dataset.from_dict(corpus.to_dict())  # in memory: `map` computes, it never finds a cached result
    pack, tokenize = [], []
    for _ in range(repeats):
        t0 = time.perf_counter(); blocks = prepare_clm(corpus, tok, seq_len); pack.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); ids = tok(list(corpus["text"]), add_special_tokens=False)["input_ids"]
        tokenize.append(time.perf_counter() - t0)
    n_packed, n_tok = len(blocks) * seq_len, sum(map(len, ids))
    train_dl, _ = get_dataloaders("clm", tok, seq_len, batch_size)
    t0, n_loaded = time.perf_counter(), 0
    for i, batch in zip(range(200), train_dl): n_loaded += batch["input_ids"].numel()
    return {"data_tokens_per_s": n_packed / statistics.median(pack),
            "tokenize_tokens_per_s": n_tok / statistics.median(tokenize),
            "loader_tokens_per_s": n_loaded / (time.perf_counter() - t0),
            "documents": len(corpus), "packed_tokens": n_packed, "pack_s": pack, "tokenize_s": tokenize}
