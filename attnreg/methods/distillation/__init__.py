"""Knowledge distillation from the unpruned model (Hinton et al. 2015; TinyBERT's layer matching).

Example:
    >>> from attnreg.methods.distillation import check_distillation
    >>> check_distillation(temperature=2.0, hidden_weight=0.0)
"""

from attnreg.methods.distillation.losses import check_distillation, distillation_loss

__all__ = ["check_distillation", "distillation_loss"]
