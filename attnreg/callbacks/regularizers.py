"""Attention-loss callbacks: a term of your own, entropy regularization and the syntax-prior KL.

Thin Lightning shells of the methods of the same names in `attnreg.methods`, which take the same
arguments: each captures only the layers it names (through the hub) and adds its weighted term to
the training loss through `attnreg.AttnRegMixin`, logged as `attnreg/<name>`, with a per-layer figure
beside it (`attnreg/<name>/layer<l>`: mean entropy, or KL). `name` left at None is the method's default,
or `<default>_2`, ... when another method holds it; two given one explicit name are an error. Each is its
method's drop-in callback (`attnreg.callbacks.base.drop_in_callback`), importable from here too.

Example:
    >>> import lightning
    >>> kl, entropy = SyntaxPriorKL(weight=1.0, layers=[0, 1], heads=[0]), EntropyRegularizer(mode="max", weight=0.01)
    >>> trainer = lightning.Trainer(callbacks=[kl, entropy], logger=False)
    >>> kl.method.name, entropy.method.name           # the names of their terms in the loss and the logs
    ('syntax_prior_kl', 'entropy_regularizer')
    >>> spread = AttentionLoss(lambda probs, batch: probs[0].var(), name="spread", layers=[0], weight=0.1)
    >>> spread.method.name, SyntaxPriorKL(heads={0: [3], 1: [4], 2: [8]}).method.layers   # one head per layer
    ('spread', [0, 1, 2])
"""

from __future__ import annotations

from attnreg import methods
from attnreg.callbacks.base import drop_in_callback

AttentionLoss = drop_in_callback(methods.AttentionLoss)
EntropyRegularizer = drop_in_callback(methods.EntropyRegularizer)
SyntaxPriorKL = drop_in_callback(methods.SyntaxPriorKL)
