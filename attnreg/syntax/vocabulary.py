"""Can a tokenizer tokenize a text? An analysis run with the wrong tokenizer gives a plausible but wrong report.

transformers builds a tokenizer even for a folder without tokenizer files (a BERT one with 5 entries,
or a byte-level one that yields no tokens): every word then becomes [UNK], or nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase


def check_tokenizer(tokenizer: PreTrainedTokenizerBase, texts: Iterable[str], max_unknown: float = 0.5) -> float:
    """The share of the words of `texts` (split on whitespace) the fast `tokenizer` cannot represent: words
    whose every piece is the unknown token, or that get no piece at all. Raises `ValueError` naming the
    share and some of those words when it is above `max_unknown`.

    Example:
        >>> from attnreg.app.task import build_tokenizer
        >>> check_tokenizer(build_tokenizer(["the", "keys"]), ["the keys rattle"])   # "rattle" is unknown
        0.333...
        >>> check_tokenizer(build_tokenizer(["x"]), ["the keys rattle"])
        Traceback (most recent call last):
        ...
        ValueError: the tokenizer cannot tokenize the text: 100% of the 3 words get only its unknown token ...
    """
    texts = list(texts)
    encoding = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    words, unknown = 0, []
    for text, ids, offsets in zip(texts, encoding["input_ids"], encoding["offset_mapping"], strict=True):
        known = bytearray(len(text))  # 1 where a character is covered by a known piece
        for token, (start, end) in zip(ids, offsets, strict=True):
            if token != tokenizer.unk_token_id:
                known[start:end] = b"\x01" * (end - start)
        for word in re.finditer(r"\S+", text):
            words += 1
            if not any(known[word.start() : word.end()]):
                unknown.append(word.group())
    share = len(unknown) / words if words else 0.0
    if share > max_unknown:
        examples = ", ".join(repr(word) for word in list(dict.fromkeys(unknown))[:5])
        raise ValueError(
            f"the tokenizer cannot tokenize the text: {share:.0%} of the {words} words get only its unknown token "
            f"({tokenizer.unk_token}) or no token at all (its vocabulary has {len(tokenizer)} entries), "
            f"e.g. {examples}. Use the tokenizer the model was trained with"
        )
    return share
