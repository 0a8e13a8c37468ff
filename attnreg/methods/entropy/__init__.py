"""Attention-entropy regularization (sharpen, flatten, or hold heads in a target band).

Example:
    >>> from attnreg.methods.entropy import EntropyRegularizer
    >>> EntropyRegularizer(mode="max", weight=0.01).name
    'entropy_regularizer'
"""

from attnreg.methods.entropy.method import EntropyRegularizer

__all__ = ["EntropyRegularizer"]
