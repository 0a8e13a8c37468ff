"""Knowledge distillation from a teacher (Hinton et al. 2015; TinyBERT's layer matching): the functional form
`distillation_loss` and the method `Distillation`, which adds it to the loss in any loop.

Example:
    >>> from attnreg.methods.distillation import check_distillation
    >>> check_distillation(temperature=2.0, hidden_weight=0.0)
"""

from attnreg.methods.distillation.losses import check_distillation, distillation_loss
from attnreg.methods.distillation.method import Distillation

__all__ = ["Distillation", "check_distillation", "distillation_loss"]
