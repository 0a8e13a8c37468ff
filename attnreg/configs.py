"""Moved to `attnreg.app.configs`: the old name warns (FutureWarning) until 0.3.0 removes it."""

from attnreg import moved

moved(__name__)
