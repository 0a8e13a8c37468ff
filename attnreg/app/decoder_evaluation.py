"""What the training app measures on a fitted decoder: held-out perplexity, parent accuracy of the supervised heads
over the words whose parent is to their left (beside the best left-offset baseline and the share of such words),
greedy continuations of a few prompts, and for a pruned model its generation speed against the unpruned one.

Each helper leaves the model's train/eval mode as it found it and returns plain, JSON-ready numbers.

Example:
    >>> from attnreg.app.lm import AgreementLMDataModule
    >>> from attnreg.app.models import tiny_causal_lm
    >>> data = AgreementLMDataModule(train=8, val=8, seed=0); data.setup("fit")
    >>> model = tiny_causal_lm(data.tokenizer)
    >>> 40 < perplexity(model, data.loader("val"))["perplexity"] < 80      # untrained: about the vocabulary's 58
    True
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from attnreg.analysis import parent_accuracy
from attnreg.app.evaluation import _number, without_silenced
from attnreg.methods.pruning import count_parameters


def _base(model: Any) -> PreTrainedModel:
    """The transformers model under a PEFT wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@torch.no_grad()
def perplexity(model: PreTrainedModel, loader: DataLoader) -> dict[str, float]:
    """exp(mean next-token loss over every predicted token of `loader`), with the loss and the token count.

    Example:
        >>> from attnreg.app.lm import LMCollator
        >>> from attnreg.app.task import build_tokenizer
        >>> from attnreg.tiny import tiny_model
        >>> tokenizer = build_tokenizer(["a", "b"])
        >>> loader = DataLoader([{"text": "a b a"}, {"text": "b"}], batch_size=2, collate_fn=LMCollator(tokenizer))
        >>> perplexity(tiny_model("llama", head="causal_lm", vocab=len(tokenizer)), loader)["tokens"]   # 4 + 2
        6
    """
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    try:
        for batch in loader:
            device = next(model.parameters()).device
            inputs = {k: batch[k].to(device) for k in ("input_ids", "attention_mask") if k in batch}
            logits = model(**inputs).logits[:, :-1].float()
            labels = batch["labels"][:, 1:].to(device)
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="sum", ignore_index=-100)
            total += float(nll)
            tokens += int((labels != -100).sum())
    finally:
        model.train(was_training)
    loss = total / max(tokens, 1)
    return {"perplexity": round(math.exp(loss), 4), "loss": round(loss, 4), "tokens": tokens}


def decoder_head_report(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[Any],
    supervised: Mapping[int, list[int] | None],
    max_length: int | None,
) -> dict[str, Any]:
    """Parent accuracy (dependent to head) over the words whose parent is to their left, the only parents a causal
    head can attend to, of the `supervised` heads ({layer: heads}, None = all) and the best head, beside the best
    left-offset baseline on the same words and the share of words that have a left parent
    (`attnreg.analysis.parent_accuracy`).

    Example:
        >>> from attnreg.app.lm import AgreementLMDataModule
        >>> from attnreg.app.models import tiny_causal_lm
        >>> data = AgreementLMDataModule(train=4, val=8, seed=0); data.setup()
        >>> report = decoder_head_report(tiny_causal_lm(data.tokenizer), data.tokenizer, data.tree_sentences(),
        ...                              {1: [0]}, 64)
        >>> sorted(report["supervised"]), report["best_offset"], 0 < report["left_parent_share"] < 1
        (['L1H0'], -2, True)
    """
    result = without_silenced(parent_accuracy(_base(model), tokenizer, sentences, max_length=max_length), model)
    table = result.accuracy
    chosen = {
        f"L{layer}H{head}": _number(table[layer, head])
        for layer, heads in sorted(supervised.items())
        for head in (range(table.shape[1]) if heads is None else heads)
    }
    present = [value for value in chosen.values() if value is not None]
    layer, head, best = result.best_head()
    offset, baseline = result.best_baseline()
    return {
        "sentences": len(sentences),
        "words": result.words,
        "left_parent_share": round(result.reachable_share(), 4),
        "supervised": chosen,
        "supervised_mean": round(sum(present) / len(present), 4) if present else None,
        "best_head": f"L{layer}H{head}",
        "best": _number(best),
        "best_offset": offset,
        "best_offset_accuracy": round(baseline, 4),
        "per_head": [[_number(value) for value in row] for row in table],
    }


def _prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str, chat: bool = False) -> list[int]:
    """The prompt's ids without end-of-text tokens (a BERT-style word-level tokenizer appends [SEP]); with `chat`, the
    prompt as a user turn rendered by the tokenizer's chat template up to the assistant's reply, as chat SFT trained
    the model to continue."""
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = tokenizer(prompt)["input_ids"]
    ends = {tokenizer.eos_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id} - {None}
    while ids and ids[-1] in ends and len(ids) > 1:
        ids = ids[:-1]
    return ids


@torch.no_grad()
def greedy_continuations(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    new_tokens: int = 16,
    chat: bool = False,
) -> dict[str, str]:
    """{prompt: its greedy continuation of `new_tokens` tokens (KV cache)}; with `chat`, each prompt goes in as a user
    turn through the tokenizer's chat template and the continuation is the assistant's reply.

    Example:
        >>> from attnreg.app.lm import TINY_CHAT_TEMPLATE
        >>> from attnreg.app.models import tiny_causal_lm
        >>> from attnreg.app.task import build_tokenizer, vocabulary
        >>> tokenizer = build_tokenizer(vocabulary())
        >>> continuation = greedy_continuations(tiny_causal_lm(tokenizer), tokenizer, ["the dog"], new_tokens=3)
        >>> len(tokenizer.tokenize(continuation["the dog"])) <= 3
        True
        >>> tokenizer = build_tokenizer([*vocabulary(), "<", "|", ">", "user", "assistant"])
        >>> tokenizer.chat_template = TINY_CHAT_TEMPLATE                      # a chat model's prompt: a user turn
        >>> tokenizer.decode(_prompt_ids(tokenizer, "the dog", chat=True))
        '< | user | > the dog < | assistant | >'
    """
    was_training = model.training
    model.eval()
    out = {}
    try:
        device = next(model.parameters()).device
        for prompt in prompts:
            ids = torch.tensor([_prompt_ids(tokenizer, prompt, chat)], device=device)
            generated = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
            out[prompt] = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True)
    finally:
        model.train(was_training)
    return out


@torch.no_grad()
def generation_speed(
    models: Mapping[str, PreTrainedModel],
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    new_tokens: int = 16,
    repetitions: int = 3,
) -> dict[str, dict[str, float]]:
    """Greedy generation tokens/s of each model (KV cache, batch 1, exactly `new_tokens` tokens per prompt),
    repetitions interleaved across the models, the median of each, and each model's parameter count.

    Example:
        >>> import copy
        >>> from attnreg.methods.pruning import prune_heads
        >>> from attnreg.tiny import tiny_model
        >>> from attnreg.app.task import build_tokenizer, vocabulary
        >>> tokenizer = build_tokenizer(vocabulary())
        >>> unpruned = tiny_model("llama", head="causal_lm", vocab=len(tokenizer))
        >>> pruned = copy.deepcopy(unpruned); _ = prune_heads(pruned, {0: [0, 1]})
        >>> speed = generation_speed({"pruned": pruned, "unpruned": unpruned}, tokenizer, ["the dog"], 4, 1)
        >>> speed["pruned"]["parameters"] < speed["unpruned"]["parameters"], speed["pruned"]["tokens_per_second"] > 0
        (True, True)
    """
    seconds: dict[str, list[float]] = {name: [] for name in models}
    modes = {name: model.training for name, model in models.items()}
    for model in models.values():
        model.eval()
    try:
        for _ in range(repetitions):
            for name, model in models.items():
                device = next(model.parameters()).device
                started = time.perf_counter()
                for prompt in prompts:
                    ids = torch.tensor([_prompt_ids(tokenizer, prompt)], device=device)
                    model.generate(
                        input_ids=ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens,
                        do_sample=False,
                        pad_token_id=tokenizer.pad_token_id,
                    )
                seconds[name].append(time.perf_counter() - started)
    finally:
        for name, model in models.items():
            model.train(modes[name])
    tokens = new_tokens * len(prompts)
    return {
        name: {
            "tokens_per_second": round(tokens / statistics.median(values), 1),
            "parameters": count_parameters(_base(models[name])),
        }
        for name, values in seconds.items()
    }
