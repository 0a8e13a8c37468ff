"""Adapters of attnreg's method objects to training frameworks other than Lightning.

`attnreg.integrations.hf.AttnRegTrainer`: the Hugging Face `Trainer` (the `hf` extra: accelerate), its events
translated for the runner in `attnreg.integrations.hf_events`.
"""
