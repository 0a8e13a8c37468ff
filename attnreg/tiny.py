"""Small randomly initialised models of every supported family, built from configs (no download).

Used by the demo, the tests and the benchmarks; sizes can be overridden to reach real shapes.

Example:
    >>> model = tiny_model("llama", head="causal_lm", hidden=64, layers=4)
    >>> model.config.num_key_value_heads
    2
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    BertConfig,
    DistilBertConfig,
    ElectraConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    RobertaConfig,
)

HEADS = {
    "base": AutoModel,
    "classification": AutoModelForSequenceClassification,
    "causal_lm": AutoModelForCausalLM,
}


def tiny_config(
    family: str, hidden: int = 32, layers: int = 2, heads: int = 4, vocab: int = 99, positions: int = 128, **extra: Any
) -> PretrainedConfig:
    """A config of `family` with the given sizes, dropout off, and grouped-query attention
    (half as many key/value heads) for the Llama-style families. `extra` sets further config attributes.

    Example:
        >>> config = tiny_config("gpt2", hidden=64, layers=3)
        >>> type(config).__name__, config.n_embd, config.n_layer, config.n_head
        ('GPT2Config', 64, 3, 4)
        >>> tiny_config("bert", num_labels=3).num_labels
        3
    """
    bert_like = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=positions,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    llama_like = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        intermediate_size=2 * hidden,
        max_position_embeddings=positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    configs = {
        "bert": lambda: BertConfig(**bert_like),
        "roberta": lambda: RobertaConfig(**{**bert_like, "max_position_embeddings": positions + 2}),
        "electra": lambda: ElectraConfig(**bert_like, embedding_size=hidden // 2),
        "distilbert": lambda: DistilBertConfig(
            vocab_size=vocab,
            dim=hidden,
            n_layers=layers,
            n_heads=heads,
            hidden_dim=2 * hidden,
            max_position_embeddings=positions,
            dropout=0.0,
            attention_dropout=0.0,
        ),
        "gpt2": lambda: GPT2Config(
            vocab_size=vocab,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_positions=positions,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        "llama": lambda: LlamaConfig(**llama_like),
        "qwen2": lambda: Qwen2Config(**llama_like),
        "mistral": lambda: MistralConfig(**llama_like, sliding_window=positions),
    }
    if family not in configs:
        raise ValueError(f"no tiny config for family {family!r}; choose one of {sorted(configs)}")
    config = configs[family]()
    for key, value in extra.items():
        setattr(config, key, value)
    return config


def tiny_model(family: str, head: str = "base", seed: int = 0, **sizes: Any) -> PreTrainedModel:
    """A randomly initialised model of `family` with the given `head` ("base", "classification",
    "causal_lm"), using SDPA attention. Like any model built from a config it starts in train mode.

    Example:
        >>> model = tiny_model("roberta", head="classification")
        >>> type(model).__name__, model.training, model.config._attn_implementation
        ('RobertaForSequenceClassification', True, 'sdpa')
    """
    if head not in HEADS:
        raise ValueError(f"head={head!r} is not one of {sorted(HEADS)}")
    torch.manual_seed(seed)
    model = HEADS[head].from_config(tiny_config(family, **sizes), attn_implementation="sdpa")
    return model
