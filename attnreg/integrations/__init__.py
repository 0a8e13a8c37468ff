"""Adapters of attnreg's method objects to training frameworks other than Lightning.

`attnreg.integrations.hf.AttnRegTrainer`: the Hugging Face `Trainer` (the `hf` extra: accelerate).
"""
