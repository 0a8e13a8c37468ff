"""Dependency trees for syntax priors: reading CoNLL-U, aligning words to subword tokens, building priors.

Example:
    >>> from attnreg.app.task import build_tokenizer, generate, vocabulary
    >>> sentences = [example.sentence for example in generate(32, seed=0)]   # or read_conllu("en_ewt-ud-dev.conllu")
    >>> sentences[0].words[:3], sentences[0].heads[:3]   # heads are 1-based word indices, 0 = root
    (('under', 'the', 'dog'), (3, 3, 11))
    >>> collate = SyntaxCollator(build_tokenizer(vocabulary()), prior="parent", max_length=128)
    >>> batch = collate(sentences)                        # model inputs + batch["attnreg_prior"]
    >>> sorted(batch), batch["attnreg_prior"].shape
    (['attention_mask', 'attnreg_prior', 'input_ids'], torch.Size([32, 23]))
"""

from attnreg.syntax.align import Alignment, AlignmentError, align_offsets, align_word_ids, dropped_arcs, word_spans
from attnreg.syntax.data import PRIOR_KEY, CollatorStats, SyntaxCollator, SyntaxDataset
from attnreg.syntax.parse import doc_to_sentence, iter_parse, load_parser, parse_texts, to_ud
from attnreg.syntax.priors import (
    KindCounts,
    SyntaxPrior,
    check_priors,
    describe_counts,
    kind_counts,
    pad_heads,
    tree_distances,
    tree_distances_batch,
    word_prior,
    word_priors,
)
from attnreg.syntax.trees import ConlluError, Sentence, check_tree, iter_conllu, read_conllu

__all__ = [
    "PRIOR_KEY",
    "Alignment",
    "AlignmentError",
    "CollatorStats",
    "KindCounts",
    "ConlluError",
    "Sentence",
    "SyntaxCollator",
    "SyntaxDataset",
    "SyntaxPrior",
    "align_offsets",
    "align_word_ids",
    "check_priors",
    "check_tree",
    "describe_counts",
    "doc_to_sentence",
    "dropped_arcs",
    "iter_conllu",
    "iter_parse",
    "kind_counts",
    "load_parser",
    "pad_heads",
    "parse_texts",
    "read_conllu",
    "to_ud",
    "tree_distances",
    "tree_distances_batch",
    "word_prior",
    "word_priors",
    "word_spans",
]
