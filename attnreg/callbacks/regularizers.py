"""Attention-loss callbacks: a term of your own, entropy regularization and the syntax-prior KL.

Thin Lightning shells of the methods of the same names in `attnreg.methods`, which take the same
arguments: each captures only the layers it names (through the hub) and adds its weighted term to
the training loss through `attnreg.AttnRegMixin`, logged as `attnreg/<name>`, with a per-layer figure
beside it (`attnreg/<name>/layer<l>`: mean entropy, or KL). `name` left at None is the method's default,
or `<default>_2`, ... when another method holds it; two given one explicit name are an error.

Example:
    >>> import lightning
    >>> kl, entropy = SyntaxPriorKL(weight=1.0, layers=[0, 1], heads=[0]), EntropyRegularizer(mode="max", weight=0.01)
    >>> trainer = lightning.Trainer(callbacks=[kl, entropy], logger=False)
    >>> kl.method.name, entropy.method.name           # the names of their terms in the loss and the logs
    ('syntax_prior_kl', 'entropy_regularizer')
"""

from __future__ import annotations

from attnreg import methods
from attnreg.callbacks.base import MethodCallback


class AttentionLoss(MethodCallback):
    """Adds `weight * fn(probs, batch)` to the training loss (`attnreg.methods.AttentionLoss`).

    Example:
        >>> spread = AttentionLoss(lambda probs, batch: probs[0].var(), name="spread", layers=[0], weight=0.1)
        >>> spread.method.name, spread.method.layers, spread.method.weight
        ('spread', [0], 0.1)
    """

    method_class = methods.AttentionLoss


class EntropyRegularizer(MethodCallback):
    """Entropy regularization of attention heads: sharpen, flatten or hold in a band
    (`attnreg.methods.EntropyRegularizer`).

    Example:
        >>> entropy = EntropyRegularizer(mode="target", target=(0.3, 0.8), layers=[4, 5], weight=0.1)
        >>> entropy.method.mode, entropy.method.target, entropy.method.layers
        ('target', (0.3, 0.8), [4, 5])
    """

    method_class = methods.EntropyRegularizer


class SyntaxPriorKL(MethodCallback):
    """KL(prior ‖ attention) for chosen heads, the prior read from the batch (`attnreg.methods.SyntaxPriorKL`).

    Example:
        >>> SyntaxPriorKL(weight=1.0, layers=[0, 1], heads=[0]).method.heads   # head 0 of layers 0 and 1
        [0]
        >>> SyntaxPriorKL(heads={0: [3], 1: [4], 2: [8]}).method.layers          # one chosen head per layer
        [0, 1, 2]
    """

    method_class = methods.SyntaxPriorKL
