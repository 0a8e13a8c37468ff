"""Moved to `attnreg.methods.pruning`: the old name works for one release, with a FutureWarning."""

from attnreg import moved

moved(__name__)
