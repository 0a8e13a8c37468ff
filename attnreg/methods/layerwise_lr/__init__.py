"""Per-layer learning rates: the functional form (`layerwise_param_groups`: named layer groups with ELECTRA's
layer-wise decay, multipliers and frozen groups) and the method objects `LayerwiseLR` and `FreezeLayers`.

Example:
    >>> from attnreg.methods.layerwise_lr import layer_group_names
    >>> layer_group_names(2)
    ['embeddings', 'layer0', 'layer1', 'head', 'gates']
"""

from attnreg.methods.layerwise_lr.groups import (
    EMBEDDINGS,
    GATES,
    HEAD,
    NO_DECAY,
    check_multipliers,
    electra_layer_factors,
    layer_group_names,
    layerwise_param_groups,
    parameters_by_layer,
    resolve_layer_groups,
)
from attnreg.methods.layerwise_lr.method import FreezeLayers, LayerwiseLR, optimizer_factory

__all__ = [
    "EMBEDDINGS",
    "GATES",
    "HEAD",
    "NO_DECAY",
    "FreezeLayers",
    "LayerwiseLR",
    "check_multipliers",
    "electra_layer_factors",
    "layer_group_names",
    "layerwise_param_groups",
    "optimizer_factory",
    "parameters_by_layer",
    "resolve_layer_groups",
]
