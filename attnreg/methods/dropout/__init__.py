"""Attention-dropout schedules: the attention (and optionally hidden) dropout rate follows training progress.

Example:
    >>> from attnreg.methods.dropout import AttentionDropoutSchedule
    >>> from attnreg.schedules import EarlyDropout
    >>> AttentionDropoutSchedule(EarlyDropout(0.1, cutoff=0.25)).name
    'attention_dropout_schedule'
"""

from attnreg.methods.dropout.method import AttentionDropoutSchedule, check_rates, hidden_dropout_modules

__all__ = ["AttentionDropoutSchedule", "check_rates", "hidden_dropout_modules"]
