"""Score a causal language model on subject-verb agreement minimal pairs (`attnreg.syntax.agreement`): a pair is
right when the verb as written gets a higher log-probability given the prefix than the verb with its number
flipped, summed over the verb's tokens; accuracy per split (without and with attractors), beside the model-free
baselines (closest noun, always singular).

Example:
    >>> from attnreg.app.task import build_tokenizer
    >>> from attnreg.syntax.agreement import AgreementPair
    >>> from attnreg.tiny import tiny_model
    >>> pairs = [AgreementPair("The keys", " are", " is", True, 1, 2, 0, True, "s1"),
    ...          AgreementPair("The key to the cabinets", " is", " are", False, 1, 5, 1, True, "s2")]
    >>> tokenizer = build_tokenizer("The keys key to the cabinets are is".split())
    >>> model = tiny_model("llama", head="causal_lm", vocab=len(tokenizer))     # a pretrained decoder in practice
    >>> scores = agreement_scores(model, tokenizer, pairs)
    >>> scores["counts"], len(scores["margins"])
    ({'without_attractors': 1, 'with_attractors': 1, 'all': 2, 'plural': 1}, 2)
    >>> scores["baselines"]["closest_noun"]["with_attractors"]
    0.0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from attnreg.syntax.agreement import SPLITS, AgreementPair, baselines, counts


def _prefix_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """`text`'s token ids, after the start token where the tokenizer adds one (and nothing at the end)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a")["input_ids"][:1] == [bos]
    return [bos, *ids] if adds_bos else ids


@torch.no_grad()
def pair_margins(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, pairs: Sequence[AgreementPair], batch_size: int = 32
) -> list[float]:
    """Per pair, log p(good | prefix) - log p(bad | prefix), each summed over the form's tokens (the forms are
    tokenized on their own, with the whitespace before them, and appended to the prefix's tokens)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    margins: list[float] = []
    for start in range(0, len(pairs), batch_size):
        sequences, spans = [], []
        for pair in pairs[start : start + batch_size]:
            prefix = _prefix_ids(tokenizer, pair.prefix)
            if not prefix:  # the first form token would be scored by the logits of the batch's last position
                raise ValueError(
                    f"agreement pair of {pair.where}: the prefix {pair.prefix!r} gives no token, and "
                    f"{type(tokenizer).__name__} adds no start token, so nothing predicts the verb"
                )
            for form in (pair.good, pair.bad):
                continuation = tokenizer(form, add_special_tokens=False)["input_ids"]
                sequences.append(prefix + continuation)
                spans.append((len(prefix), len(prefix) + len(continuation)))
        width = max(len(sequence) for sequence in sequences)
        input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences], device=device)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], device=device)
        logits = model(input_ids=input_ids, attention_mask=mask).logits
        rows = torch.tensor([row for row, (b, e) in enumerate(spans) for _ in range(b, e)], device=device)
        positions = torch.tensor([p for b, e in spans for p in range(b, e)], device=device)
        chosen = logits[rows, positions - 1].float().log_softmax(-1)  # only the predicted positions' vocabulary
        scores = torch.zeros(len(spans), device=device).index_add_(
            0, rows, chosen.gather(-1, input_ids[rows, positions, None]).squeeze(-1)
        )
        margins += (scores[0::2] - scores[1::2]).tolist()
    model.train(was_training)
    return margins


def agreement_scores(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, pairs: Sequence[AgreementPair], batch_size: int = 32
) -> dict[str, Any]:
    """`counts`, `accuracy` and mean `margin` per split (`SPLITS`; accuracy 0-1, None for an empty split), the
    model-free `baselines` on the same pairs, and the per-pair `margins` (for paired tests across models)."""
    margins = pair_margins(model, tokenizer, pairs, batch_size)
    accuracy: dict[str, float | None] = {}
    margin: dict[str, float | None] = {}
    for split in SPLITS:
        chosen = [m for m, pair in zip(margins, pairs, strict=True) if split in ("all", pair.split)]
        accuracy[split] = sum(m > 0 for m in chosen) / len(chosen) if chosen else None
        margin[split] = sum(chosen) / len(chosen) if chosen else None
    return {
        "counts": counts(pairs),
        "accuracy": accuracy,
        "margin": margin,
        "baselines": baselines(pairs),
        "margins": margins,
    }
