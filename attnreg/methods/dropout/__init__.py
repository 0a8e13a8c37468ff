"""Attention-dropout schedules: the attention (and optionally hidden) dropout rate follows training progress.

Example:
    >>> from attnreg.methods.dropout import DropoutSchedule
    >>> from attnreg.schedules import EarlyDropout
    >>> DropoutSchedule(EarlyDropout(0.1, cutoff=0.25)).name
    'attention_dropout'
"""

from attnreg.methods.dropout.method import DropoutSchedule, check_rates, hidden_dropout_modules

__all__ = ["DropoutSchedule", "check_rates", "hidden_dropout_modules"]
