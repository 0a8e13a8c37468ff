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
    Cohere2Config,
    CohereConfig,
    DistilBertConfig,
    ElectraConfig,
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    GPT2Config,
    GPTJConfig,
    GPTNeoXConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    ModernBertConfig,
    Olmo2Config,
    Olmo3Config,
    Phi3Config,
    PhiConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    RobertaConfig,
    SmolLM3Config,
    StableLmConfig,
    XLMRobertaConfig,
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
    bert_like: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=positions,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    llama_like: dict[str, Any] = dict(
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
        "xlm-roberta": lambda: XLMRobertaConfig(**{**bert_like, "max_position_embeddings": positions + 2}),
        "mixtral": lambda: MixtralConfig(
            **llama_like, sliding_window=positions, num_local_experts=4, num_experts_per_tok=2
        ),
        "granite": lambda: GraniteConfig(
            **llama_like,
            attention_multiplier=0.2,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            logits_scaling=2.0,
        ),
        "phi3": lambda: Phi3Config(**llama_like, original_max_position_embeddings=positions, sliding_window=positions),
        "qwen3": lambda: Qwen3Config(
            **llama_like,
            head_dim=hidden // heads,
            use_sliding_window=True,
            sliding_window=positions,
            layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        ),
        "qwen3_moe": lambda: Qwen3MoeConfig(
            **llama_like,
            head_dim=hidden // heads,
            use_sliding_window=True,
            sliding_window=positions,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden,
        ),
        "modernbert": lambda: ModernBertConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=2 * hidden,
            max_position_embeddings=positions,
            local_attention=2 * positions,
            layer_types=[("full_attention", "sliding_attention")[i % 2] for i in range(layers)],
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            cls_token_id=1,
            sep_token_id=2,
        ),
        "smollm3": lambda: SmolLM3Config(
            **llama_like,
            use_sliding_window=True,
            sliding_window=positions,
            no_rope_layer_interval=2,
            layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        ),
        "cohere2": lambda: Cohere2Config(
            **llama_like,
            sliding_window=positions,
            layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        ),
        "cohere": lambda: CohereConfig(**llama_like, use_qk_norm=True),
        "stablelm": lambda: StableLmConfig(
            **llama_like, qk_layernorm=True, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}
        ),
        "olmo2": lambda: Olmo2Config(**llama_like),
        "olmo3": lambda: Olmo3Config(
            **llama_like,
            sliding_window=positions,
            layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        ),
        "phi": lambda: PhiConfig(
            **llama_like, qk_layernorm=True, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}
        ),
        "gptj": lambda: GPTJConfig(
            vocab_size=vocab,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_positions=positions,
            rotary_dim=hidden // heads // 2,
            n_inner=2 * hidden,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        "gpt_neox": lambda: GPTNeoXConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=2 * hidden,
            max_position_embeddings=positions,
            rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5},
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        "gemma3": lambda: Gemma3Config(  # the text stack of the image-text model, with a one-layer vision tower
            text_config=tiny_config("gemma3_text", hidden, layers, heads, vocab, positions).to_dict(),
            vision_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=8,
                patch_size=4,
            ),
            mm_tokens_per_image=4,
            boi_token_index=vocab - 3,
            eoi_token_index=vocab - 2,
            image_token_index=vocab - 1,
        ),
        "gemma2": lambda: Gemma2Config(  # softcap 1.0 on the logits: small enough that capping changes them
            **llama_like,
            head_dim=hidden // heads,
            query_pre_attn_scalar=hidden // heads,
            sliding_window=positions,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=None,
            layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        ),
        "gpt_oss": lambda: GptOssConfig(  # a learned sink logit per head; mixture-of-experts feed-forward
            **llama_like,
            head_dim=hidden // heads,
            sliding_window=positions,
            layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        "gemma3_text": lambda: Gemma3TextConfig(
            **llama_like,
            head_dim=hidden // heads,
            query_pre_attn_scalar=hidden // heads,
            sliding_window=positions,
            layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        ),
    }
    if family not in configs:
        raise ValueError(f"no tiny config for family {family!r}; choose one of {sorted(configs)}")
    config = configs[family]()
    for key, value in extra.items():
        setattr(config, key, value)
    return config


def tiny_model(family: str, head: str = "base", seed: int = 0, **sizes: Any) -> PreTrainedModel:
    """A randomly initialised model of `family` with the given `head` ("base", "classification",
    "causal_lm"), using SDPA attention (eager for a family without it: Gemma 2, gpt-oss). Like any model built from a
    config it starts in train mode.

    Example:
        >>> model = tiny_model("roberta", head="classification")
        >>> type(model).__name__, model.training, model.config._attn_implementation
        ('RobertaForSequenceClassification', True, 'sdpa')
    """
    return model_from_config(tiny_config(family, **sizes), head, seed)


def model_from_config(config: PretrainedConfig, head: str = "base", seed: int = 0) -> PreTrainedModel:
    """A randomly initialised model of `config` with the given `head`, on SDPA where the model class has it,
    else eager (Gemma 2, gpt-oss).

    Example:
        >>> model_from_config(tiny_config("gemma2"), head="causal_lm").config._attn_implementation
        'eager'
    """
    if head not in HEADS:
        raise ValueError(f"head={head!r} is not one of {sorted(HEADS)}")
    torch.manual_seed(seed)
    try:
        return HEADS[head].from_config(config, attn_implementation="sdpa")
    except ValueError:  # "does not support ... scaled_dot_product_attention yet"
        torch.manual_seed(seed)
        return HEADS[head].from_config(config, attn_implementation="eager")
