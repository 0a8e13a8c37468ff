"""The keyword policy of attnreg's attention function: which keyword arguments it may ignore, which it implements,
and the clear error for any other (a keyword the hub would silently drop would compute something else than the
model).

Example:
    >>> from attnreg.hub import attach
    >>> from attnreg.tiny import tiny_model
    >>> hub = attach(tiny_model("bert"))
    >>> check_kwargs(hub.attention(0), {"position_ids": None, "use_cache": True, "attnreg_prior": 1})  # accepted
    >>> check_kwargs(hub.attention(0), {"position_bias": 1})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    NotImplementedError: attnreg's attention function received keyword argument(s) ['position_bias'] from ...
"""

from __future__ import annotations

from torch import nn

OWN_BATCH_KEYS = "attnreg_"  # attnreg's own batch entries (a syntax prior) that a model's **kwargs pass along
PACKING_KWARG = "attnreg_packing"  # the hub's `eager.Packing` of a forward whose rows hold several documents
IGNORED_KWARGS = frozenset(
    {
        # Read by the layer or the model, or meaningless for the attention function itself:
        # Positions are already in q and k (RoPE). Packed documents (position_ids restarting at 0 within a row) are
        # read once per forward by the hub's model hook, which hands every layer PACKING_KWARG.
        "position_ids",
        "use_cache",
        "cache_position",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "num_items_in_batch",  # the Trainer's loss normaliser, forwarded by every **kwargs
        "token_type_ids",
        "encoder_hidden_states",  # BERT-like self-attention: keys and values are already projected
        "encoder_attention_mask",
        "seq_idx",
        # The 4-D mask the layer receives already admits only the window (SDPA ignores the keyword too).
        "sliding_window",
        # Flash-attention varlen metadata: SDPA ignores it; the documents it delimits are kept apart from the
        # position_ids that come with it (PACKING_KWARG).
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "deterministic",  # ModernBERT's flash-attention determinism flag
    }
)
"""Keyword arguments an attention function may receive and ignore: every path of the hub (SDPA hand-off,
capture, blockwise inputs) computes what eager attention computes without them. Two more are implemented on every
path: `softcap` (Gemma 2) and `s_aux` (gpt-oss's sinks). Any other keyword with a value (`position_bias`, `alibi`,
a typo) is refused by `attention_forward`, naming it."""


HEAD_MASK_MESSAGE = (
    "head_mask= was passed to a model under attnreg. transformers v5 no longer supports head masks and "
    "silently ignores them; use hub.gate(layer) (set a head's gate to 0 to mask it) or attnreg.methods.pruning."
)


def check_kwargs(module: nn.Module, kwargs: dict) -> None:
    """Raise for a keyword argument the hub does not implement (a `None` value is accepted: nothing to do)."""
    if kwargs.get("head_mask") is not None:
        raise ValueError(HEAD_MASK_MESSAGE)
    unknown = sorted(
        key
        for key in kwargs.keys() - IGNORED_KWARGS
        if kwargs[key] is not None and key != "head_mask" and not key.startswith(OWN_BATCH_KEYS)
    )
    if unknown:
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        raise NotImplementedError(
            f"attnreg's attention function received keyword argument(s) {unknown} from {type(module).__name__} "
            f"(model_type={model_type!r}), which it does not implement: capture, temperature, gates and the "
            "blockwise losses would compute something else than the model. Known keywords it may ignore: "
            f"{sorted(IGNORED_KWARGS)}."
        )
