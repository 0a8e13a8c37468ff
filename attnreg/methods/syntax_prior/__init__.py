"""The syntax-prior KL: chosen heads pulled toward a distribution built from a dependency parse.

Example:
    >>> from attnreg.methods.syntax_prior import SyntaxPriorKL
    >>> SyntaxPriorKL(heads={0: [3], 1: [4]}).name
    'syntax_prior_kl'
"""

from attnreg.methods.syntax_prior.method import SyntaxPriorKL

__all__ = ["SyntaxPriorKL"]
