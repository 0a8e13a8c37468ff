"""Moved to `attnreg.methods.layerwise_lr`: the old name warns (FutureWarning) until 0.3.0 removes it."""

from attnreg import moved

moved(__name__)
