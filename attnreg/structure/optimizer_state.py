"""Optimizer state across a pruning: per-parameter state sliced like the parameters, removed parameters dropped."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from attnreg.heads import PruneReport, SlicedTensor


def slice_optimizer_state(optimizer: torch.optim.Optimizer, sliced: Iterable[SlicedTensor] | PruneReport) -> None:
    """Cut an optimizer's per-parameter state (Adam's `exp_avg`, `exp_avg_sq`, momentum...) like the
    parameters were cut, so the moments of the kept heads carry on. Parameter groups are untouched.
    `prune_heads(model, heads, optimizers=[...])` calls it.

    Example:
        >>> from attnreg.methods.pruning import prune_heads
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert")
        >>> optimizer = torch.optim.Adam(model.parameters())
        >>> model(input_ids=torch.tensor([[2, 5, 6, 3]])).last_hidden_state.sum().backward(); optimizer.step()
        >>> report = prune_heads(model, {0: [0, 1]})                     # without optimizers=...
        >>> query = model.encoder.layer[0].attention.self.query.weight
        >>> optimizer.state[query]["exp_avg"].shape, query.shape
        (torch.Size([32, 32]), torch.Size([16, 32]))
        >>> slice_optimizer_state(optimizer, report); optimizer.state[query]["exp_avg"].shape
        torch.Size([16, 32])
    """
    if isinstance(sliced, PruneReport):
        sliced = sliced.sliced
    for item in sliced:
        state = optimizer.state.get(item.tensor)
        if not state:
            continue
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.shape == item.old_shape:
                state[key] = value.index_select(item.dim, item.index.to(value.device)).contiguous()


def drop_from_optimizer(optimizer: torch.optim.Optimizer, parameters: Iterable[torch.Tensor]) -> None:
    """Remove parameters (folded gates) from an optimizer's groups and state; groups themselves stay,
    so LR schedulers keep working.

    Example:
        >>> gate, weight = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2))
        >>> optimizer = torch.optim.SGD([{"params": [weight]}, {"params": [gate]}], lr=0.1)
        >>> drop_from_optimizer(optimizer, [gate])
        >>> [len(group["params"]) for group in optimizer.param_groups]
        [1, 0]
    """
    dropped = {id(p) for p in parameters}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in dropped]
    for parameter in [p for p in optimizer.state if id(p) in dropped]:
        del optimizer.state[parameter]


def _as_list(optimizers: Iterable[torch.optim.Optimizer] | torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    return [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
