"""Hub gates: folding them into the weights, their parameters, and the hard-concrete (L0) gate."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from attnreg import weights
from attnreg.families import detect_family
from attnreg.hub import AttentionHub, gate_values, hub_of
from attnreg.records import GATE
from attnreg.structure.optimizer_state import _as_list, drop_from_optimizer

FOLDED = "_attnreg_folded_gates"  # on the transformers model: {layer: gate values folded into its output projection}


def fold_gates(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> list[nn.Parameter]:
    """Fold every hub gate (gate modules such as `HardConcreteGate` at their eval-mode value) into the
    output projections and remove the gates; the model computes the same function without them.

    The gates' parameters are dropped from `optimizers` and returned.

    Example:
        >>> from attnreg.hub import attach
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert").eval(); hub = attach(model); ids = torch.tensor([[5, 6, 7]])
        >>> _ = make_hard_concrete(hub, 0, initial_log_alpha=0.0)           # every head of layer 0 at 0.5
        >>> _ = hub.gate(1).data.copy_(torch.tensor([1.0, 0.5, 0.0, 2.0]))   # a plain gate on layer 1
        >>> optimizer = torch.optim.Adam(gate_parameters(model))
        >>> with torch.no_grad():
        ...     gated = model(input_ids=ids).last_hidden_state
        ...     removed = fold_gates(model, [optimizer])
        ...     torch.allclose(model(input_ids=ids).last_hidden_state, gated, atol=1e-6)
        True
        >>> hub.gates, [tuple(p.shape) for p in removed], optimizer.param_groups[0]["params"]
        ({}, [(4,), (4,)], [])
    """
    hub = _hub_or_none(model)
    if hub is None:
        return []
    removed = []
    record = folded_gates(hub.model)
    for layer in list(hub.gates):
        with torch.no_grad():
            values = gate_values(hub.gates[layer], deterministic=True).detach().float().cpu()
        earlier = record.get(layer)
        record[layer] = (values * torch.tensor(earlier) if earlier is not None else values).tolist()
        removed += _remove_gate(hub, layer, fold=True)
    setattr(hub.model, FOLDED, record)
    for optimizer in _as_list(optimizers):
        drop_from_optimizer(optimizer, removed)
    return removed


def folded_gates(model: nn.Module) -> dict[int, list[float]]:
    """The gate values `fold_gates` folded into each layer's output projection (per current head), by layer: what a
    checkpoint that lacks the base weights (a PEFT adapter's) needs to fold them again (`refold_gates`).

    Example:
        >>> from attnreg.hub import attach
        >>> from attnreg.tiny import tiny_model
        >>> model = tiny_model("bert"); hub = attach(model)
        >>> _ = hub.gate(1).data.copy_(torch.tensor([1.0, 0.5, 0.0, 2.0]))
        >>> _ = fold_gates(model); folded_gates(model)
        {1: [1.0, 0.5, 0.0, 2.0]}
    """
    return dict(getattr(_transformers_model(model), FOLDED, {}))


def refold_gates(model: nn.Module, values: Mapping[int, Sequence[float]]) -> None:
    """Fold recorded gate values (`folded_gates` of the model a checkpoint was taken from) into the output
    projections of a model rebuilt for a resume, its heads already removed as they were; a layer's gate, if
    the method made one again, is taken off unfolded. Weights the checkpoint holds load over the result; a PEFT
    checkpoint holds only the adapter, whose frozen base gets its folded gates this way.

    Example:
        >>> from attnreg.hub import attach
        >>> from attnreg.tiny import tiny_model
        >>> trained, fresh = tiny_model("bert"), tiny_model("bert")
        >>> _ = attach(trained).gate(0).data.copy_(torch.tensor([1.0, 0.5, 0.0, 2.0])); _ = fold_gates(trained)
        >>> refold_gates(fresh, folded_gates(trained))
        >>> torch.equal(fresh.encoder.layer[0].attention.output.dense.weight,
        ...             trained.encoder.layer[0].attention.output.dense.weight)
        True
    """
    model = _transformers_model(model)
    family = detect_family(model)
    hub = _hub_or_none(model)
    record = folded_gates(model)
    for layer, scale in values.items():
        layer = int(layer)
        if hub is not None:
            _remove_gate(hub, layer, fold=False)
        attention = family.attention_module(model, layer)
        scale = torch.tensor(scale, dtype=torch.float32)
        weights.scale_input_columns(
            family.out_projection(model, layer), scale.repeat_interleave(family.head_dim(attention))
        )
        record[layer] = scale.tolist()
    setattr(model, FOLDED, record)


def _transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model of a `PeftModel` (`get_base_model`), else `model`."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def gate_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of every hub gate of `model` (plain gates, and those of gate modules such as
    `HardConcreteGate`): for an optimizer group of their own, since gates usually need a far larger
    learning rate than the pretrained weights. Empty without a hub.

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> from attnreg.hub import attach
        >>> model = tiny_model("bert"); hub = attach(model)
        >>> _ = make_hard_concrete(hub, 0); _ = hub.gate(1)           # an L0 gate on layer 0, a plain one on 1
        >>> gates = gate_parameters(model); ids = {id(p) for p in gates}
        >>> [tuple(p.shape) for p in gates]
        [(4,), (4,)]
        >>> rest = [p for p in model.parameters() if id(p) not in ids]
        >>> groups = [{"params": rest, "lr": 5e-5}, {"params": gates, "lr": 0.2, "weight_decay": 0.0}]
        >>> optimizer = torch.optim.AdamW(groups)
    """
    hub = _hub_or_none(model)
    if hub is None:
        return []
    found = []
    for gate in hub.gates.values():
        found += list(gate.parameters()) if isinstance(gate, nn.Module) else [gate]
    return found


def _remove_gate(hub: AttentionHub, layer: int, fold: bool) -> list[nn.Parameter]:
    """Remove the gate of `layer` (folded into the weights or not) and return its parameters."""
    gate = getattr(hub.attention(layer), GATE, None)
    if gate is None:
        return []
    parameters = list(gate.parameters()) if isinstance(gate, nn.Module) else [gate]
    hub.remove_gate(layer, fold=fold)
    return parameters


def _hub_or_none(model: nn.Module) -> AttentionHub | None:
    """The hub attached to `model`, or None (every module of the package asks here)."""
    try:
        return hub_of(model)
    except RuntimeError:
        return None


class HardConcreteGate(nn.Module):
    """Hard-concrete (L0) gates for the heads of one layer: Louizos et al. 2018, as Voita et al. 2019.

    Calling it samples `z = clamp(sigmoid((log u - log(1 - u) + log_alpha) / temperature) * (hi - lo) + lo, 0, 1)`
    in training and returns the deterministic `clamp(sigmoid(log_alpha) * (hi - lo) + lo, 0, 1)` in eval.
    Install it with `make_hard_concrete`; the hub applies it like a plain gate.

    Example:
        >>> gate = HardConcreteGate(num_heads=12, initial_log_alpha=2.0)
        >>> gate.expected_l0().sum()       # expected number of open heads, differentiable
        tensor(11.6804, grad_fn=<SumBackward0>)
        >>> gate.eval()(), gate.train()().shape    # eval: the deterministic gate; training: a sample
        (tensor([1., 1., 1., 1., 1., 1., 1., 1., 1., 1., 1., 1.], grad_fn=<ClampBackward1>), torch.Size([12]))
    """

    def __init__(
        self,
        num_heads: int,
        initial_log_alpha: float = 2.0,
        temperature: float = 2.0 / 3.0,
        stretch: tuple[float, float] = (-0.1, 1.1),
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        low, high = stretch
        if not low < 0.0 < 1.0 < high:
            raise ValueError(f"stretch must satisfy low < 0 < 1 < high, got {tuple(stretch)}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)
        self.stretch = (float(low), float(high))
        self.log_alpha = nn.Parameter(torch.full((num_heads,), float(initial_log_alpha), dtype=dtype, device=device))

    def forward(self) -> torch.Tensor:
        if not self.training:
            return self.deterministic()
        low, high = self.stretch
        noise = torch.rand_like(self.log_alpha).clamp(1e-6, 1 - 1e-6)
        s = torch.sigmoid((torch.log(noise) - torch.log1p(-noise) + self.log_alpha) / self.temperature)
        return (s * (high - low) + low).clamp(0.0, 1.0)

    def deterministic(self) -> torch.Tensor:
        """The test-time gate: clamp(sigmoid(log_alpha) * (hi - lo) + lo, 0, 1)."""
        low, high = self.stretch
        return (torch.sigmoid(self.log_alpha) * (high - low) + low).clamp(0.0, 1.0)

    def expected_l0(self) -> torch.Tensor:
        """P(gate != 0) per head: sigmoid(log_alpha - temperature * log(-lo / hi))."""
        low, high = self.stretch
        return torch.sigmoid(self.log_alpha - self.temperature * math.log(-low / high))

    def extra_repr(self) -> str:
        return f"heads={self.log_alpha.numel()}, temperature={self.temperature:.4g}, stretch={self.stretch}"


def make_hard_concrete(
    hub: AttentionHub,
    layer: int,
    initial_log_alpha: float = 2.0,
    temperature: float = 2.0 / 3.0,
    stretch: tuple[float, float] = (-0.1, 1.1),
) -> HardConcreteGate:
    """Install a `HardConcreteGate` as the hub gate of `layer` (or return the one already there).

    Its log-alpha is saved in the state_dict as `...attnreg_gate.log_alpha`.

    Example:
        >>> from attnreg.hub import attach
        >>> from attnreg.tiny import tiny_model
        >>> hub = attach(tiny_model("bert"))
        >>> gate = make_hard_concrete(hub, 1, initial_log_alpha=3.0)
        >>> gate, make_hard_concrete(hub, 1) is gate, gate.training        # follows the model's train mode
        (HardConcreteGate(heads=4, temperature=0.6667, stretch=(-0.1, 1.1)), True, True)
        >>> [key for key in hub.model.state_dict() if "attnreg_gate" in key]
        ['encoder.layer.1.attention.self.attnreg_gate.log_alpha']
        >>> _ = hub.gate(0); make_hard_concrete(hub, 0)
        Traceback (most recent call last):
        ...
        ValueError: layer 0 already has a Parameter gate; remove it first
    """
    existing = getattr(hub.attention(layer), GATE, None)
    if isinstance(existing, HardConcreteGate):
        return existing
    if existing is not None:
        raise ValueError(f"layer {layer} already has a {type(existing).__name__} gate; remove it first")
    num_heads = hub.layers[layer].num_heads
    weight = hub.family.out_projection(hub.model, layer).weight
    gate = HardConcreteGate(num_heads, initial_log_alpha, temperature, stretch, weight.dtype, weight.device)
    gate.train(hub.attention(layer).training)  # follow the model's mode
    hub.install_gate(layer, gate)
    return gate


def hard_concrete(hub: AttentionHub, layer: int) -> HardConcreteGate | None:
    """The hard-concrete gate of `layer`, or None.

    Example:
        >>> from attnreg.hub import attach
        >>> from attnreg.tiny import tiny_model
        >>> hub = attach(tiny_model("bert"))
        >>> gate = make_hard_concrete(hub, 0); _ = hub.gate(1)     # an L0 gate on layer 0, a plain one on 1
        >>> hard_concrete(hub, 0) is gate, hard_concrete(hub, 1)
        (True, None)
    """
    gate = getattr(hub.attention(layer), GATE, None)
    return gate if isinstance(gate, HardConcreteGate) else None
