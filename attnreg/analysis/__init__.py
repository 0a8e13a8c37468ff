"""Attention analysis: head statistics, head roles, syntactic accuracy, token importance, collapse checks.

One streaming pass (`analyze`) fills everything; no attention map outlives its batch.

Example:
    >>> from attnreg.analysis import analyze
    >>> from attnreg.syntax import read_conllu
    >>> analysis = analyze(model, tokenizer, read_conllu("en_ewt-ud-dev.conllu"))
    >>> analysis.statistics["entropy"]                 # [layers, heads], normalized entropy
    >>> analysis.syntax.best_head(), analysis.syntax.baseline(1)
    >>> analysis.syntax.relation_table(min_words=100)  # best head per relation, both directions
    >>> analysis.roles().grid()                        # "positional", "syntactic", "no-op", ...
    >>> analysis.similarity.collapsed(threshold=0.9)   # layers whose token states collapsed
"""

from attnreg.analysis.dependencies import (
    DIRECTIONS,
    Direction,
    ParentAccuracy,
    SyntaxTargets,
    batch_word_attention,
    predicted_heads,
    word_attention,
)
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
    head_output_norms,
    head_roles,
)
from attnreg.analysis.representations import TokenSimilarity, mean_token_similarity, token_importance
from attnreg.analysis.runner import Analysis, analyze, head_statistics, parent_accuracy
from attnreg.analysis.vocabulary import check_tokenizer

__all__ = [
    "ATTENTION_STATISTICS",
    "DIRECTIONS",
    "KINDS",
    "ROLES",
    "STATISTICS",
    "Analysis",
    "Direction",
    "HeadRole",
    "HeadRoles",
    "HeadStatistics",
    "ParentAccuracy",
    "RoleThresholds",
    "SyntaxTargets",
    "TokenKinds",
    "TokenSimilarity",
    "analyze",
    "attention_statistics",
    "batch_word_attention",
    "check_tokenizer",
    "head_output_norms",
    "head_roles",
    "head_statistics",
    "mean_token_similarity",
    "parent_accuracy",
    "predicted_heads",
    "token_importance",
    "word_attention",
]
