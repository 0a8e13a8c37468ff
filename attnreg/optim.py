"""Moved to `attnreg.methods.layerwise_lr`: the old name works for one release, with a FutureWarning."""

from attnreg import moved

moved(__name__)
