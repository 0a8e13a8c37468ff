"""Dependency trees for syntax priors: reading CoNLL-U, aligning words to subword tokens, building priors.

Example:
    >>> sentences = attnreg.syntax.read_conllu("../shared/data/ud_english_ewt/en_ewt-ud-dev.conllu")
    >>> sentences[0].words[:3], sentences[0].heads[:3]   # heads are 1-based word indices, 0 = root
"""

from attnreg.syntax.trees import ConlluError, Sentence, check_tree, iter_conllu, read_conllu

__all__ = ["ConlluError", "Sentence", "check_tree", "iter_conllu", "read_conllu"]
