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
    tokenized on their own, with the whitespace before them, and appended to the prefix's tokens). Where both forms
    are one token the prefix alone is run and both are read from its last logits; sequences are batched by length
    (little padding): the same margins as one pair at a time, in a fraction of the time."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sequences: list[list[int]] = []
    targets: list[list[tuple[int, int, int, int]]] = []  # per sequence: (pair, sign, position, token) of form tokens
    for index, pair in enumerate(pairs):
        prefix = _prefix_ids(tokenizer, pair.prefix)
        if not prefix:  # the first form token would be scored by the logits of the batch's last position
            raise ValueError(
                f"agreement pair of {pair.where}: the prefix {pair.prefix!r} gives no token, and "
                f"{type(tokenizer).__name__} adds no start token, so nothing predicts the verb"
            )
        good, bad = (tokenizer(form, add_special_tokens=False)["input_ids"] for form in (pair.good, pair.bad))
        if len(good) == len(bad) == 1:  # one run of the prefix scores both, from its last logits
            sequences.append(prefix)
            targets.append([(index, 1, len(prefix), good[0]), (index, -1, len(prefix), bad[0])])
            continue
        for sign, form in ((1, good), (-1, bad)):
            sequences.append(prefix + form)
            targets.append([(index, sign, len(prefix) + i, token) for i, token in enumerate(form)])
    margins = torch.zeros(len(pairs), dtype=torch.float64)
    order = sorted(range(len(sequences)), key=lambda row: len(sequences[row]))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = max(len(sequences[row]) for row in chunk)
        input_ids = torch.tensor([sequences[r] + [pad] * (width - len(sequences[r])) for r in chunk], device=device)
        mask = torch.tensor([[1] * len(sequences[r]) + [0] * (width - len(sequences[r])) for r in chunk], device=device)
        logits = model(input_ids=input_ids, attention_mask=mask).logits
        found = [(row, *target) for row, sequence_row in enumerate(chunk) for target in targets[sequence_row]]
        rows, owners, signs, positions, tokens = zip(*found, strict=True)
        # a token at position p is predicted by the logits at p - 1
        chosen = logits[torch.tensor(rows, device=device), torch.tensor(positions, device=device) - 1].float()
        scores = chosen.log_softmax(-1).gather(-1, torch.tensor(tokens, device=device)[:, None]).squeeze(-1)
        signed = scores.double().cpu() * torch.tensor(signs, dtype=torch.float64)
        margins.index_add_(0, torch.tensor(owners), signed)
    model.train(was_training)
    return margins.tolist()


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
