"""Attention analysis: head statistics, head roles, syntactic accuracy, token importance, collapse checks.

One streaming pass (`analyze`) fills everything; no attention map outlives its batch, and with
`blockwise=True` (by default above `BLOCKWISE_LENGTH` tokens) none is built at all: each layer is reduced
from its queries and keys in blocks of query rows (`attnreg.analysis.blocks`), for long documents on decoders.

Example:
    >>> from attnreg.app.task import build_tokenizer, generate, vocabulary
    >>> from attnreg.tiny import tiny_model
    >>> tokenizer = build_tokenizer(vocabulary())
    >>> model = tiny_model("bert", vocab=len(tokenizer))              # a pretrained model in practice
    >>> sentences = [example.sentence for example in generate(8, seed=0)]   # or read_conllu("en_ewt-ud-dev.conllu")
    >>> analysis = analyze(model, tokenizer, sentences)
    >>> analysis.statistics["entropy"].shape           # [layers, heads], normalized entropy
    torch.Size([2, 4])
    >>> round(analysis.syntax.baseline(1), 3)          # right-branching; analysis.syntax.best_head() for the heads
    0.451
    >>> [row["relation"] for row in analysis.syntax.relation_table(min_words=10)]   # best head per relation
    ['all', 'det', 'nsubj', 'obj', 'punct']
    >>> analysis.roles().grid()                        # "positional", "syntactic", "no-op", ...
    [['broad', 'broad', 'broad', 'broad'], ['broad', 'broad', 'broad', 'broad']]
    >>> analysis.similarity.collapsed(threshold=0.9)   # layers whose token states collapsed
    []
"""

from attnreg.analysis.blocks import (
    AttentionBlock,
    attention_blocks,
    block_statistics,
    block_word_attention,
    layer_by_layer,
)
from attnreg.analysis.dependencies import (
    DIRECTIONS,
    Direction,
    ParentAccuracy,
    SyntaxTargets,
    batch_word_attention,
    predicted_heads,
    word_attention,
)
from attnreg.analysis.head_view import HeadView, head_arcs, head_view
from attnreg.analysis.heads import (
    ATTENTION_STATISTICS,
    KINDS,
    ROLES,
    STATISTICS,
    HeadRole,
    HeadRoles,
    HeadStatistics,
    RoleThresholds,
    TokenKinds,
    attention_statistics,
    first_token_attention,
    head_output_norms,
    head_roles,
)
from attnreg.analysis.representations import TokenSimilarity, mean_token_similarity, token_importance
from attnreg.analysis.runner import BLOCKWISE_LENGTH, Analysis, analyze, head_statistics, parent_accuracy
from attnreg.syntax.vocabulary import check_tokenizer

__all__ = [
    "ATTENTION_STATISTICS",
    "BLOCKWISE_LENGTH",
    "DIRECTIONS",
    "KINDS",
    "ROLES",
    "STATISTICS",
    "Analysis",
    "AttentionBlock",
    "Direction",
    "HeadRole",
    "HeadRoles",
    "HeadStatistics",
    "HeadView",
    "ParentAccuracy",
    "RoleThresholds",
    "SyntaxTargets",
    "TokenKinds",
    "TokenSimilarity",
    "analyze",
    "attention_blocks",
    "attention_statistics",
    "batch_word_attention",
    "block_statistics",
    "block_word_attention",
    "check_tokenizer",
    "first_token_attention",
    "head_arcs",
    "head_output_norms",
    "head_roles",
    "head_statistics",
    "head_view",
    "layer_by_layer",
    "mean_token_similarity",
    "parent_accuracy",
    "predicted_heads",
    "token_importance",
    "word_attention",
]
