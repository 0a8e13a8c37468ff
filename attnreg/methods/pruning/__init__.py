"""Head pruning: physical removal of attention heads, saving and loading pruned models, head importance.

Every family in `attnreg.families` is supported; the code asks the family table where the query, key,
value and output projections are and never branches on the family. Heads keep their *original*
numbers across successive prunings (the convention of transformers v4's `prune_heads`), and the
record of removed heads is kept in `model.config.attnreg_pruned_heads`, so it is saved with config.json.

Grouped-query models (Llama, Qwen2, Mistral): a key/value head is shared by a group of query heads,
and can go only when its whole group goes. Requested heads of a group that keeps other heads are
silenced in place instead (`silence_heads`): they add exactly nothing, as if their gate were 0, stay so
through training, saving and loading, and are recorded in `model.config.attnreg_silenced_heads`;
`PruneReport.kept` says which and why. A later request that takes the rest of their group removes them.

One module per concern, everything public re-exported here: `record` (what was removed or silenced,
original head numbers, `PruneReport`), `surgery` (`prune_heads`, `silence_heads`), `optimizer_state`,
`gates` (folding, `gate_parameters`, `HardConcreteGate`), `saving` (`save_pruned`, `load_pruned`),
`checkpoints` (checkpoint dicts, for Lightning's hooks) and `importance` (`head_importance`,
`select_heads`, `iterative_pruning`).

Example:
    >>> import tempfile
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("bert", head="classification")   # 2 layers x 4 heads
    >>> report = prune_heads(model, {0: [1, 3], 1: [0]})
    >>> report.heads, pruned_heads(model)
    ({0: (2, 2), 1: (3, 3)}, {0: (1, 3), 1: (0,)})
    >>> prune_heads(model, {0: [2]}).heads[0]                # original numbers: head 2 is still head 2
    (1, 1)
    >>> folder = save_pruned(model, tempfile.mkdtemp())      # tokenizer=... saves it beside the model
    >>> pruned_heads(load_pruned(folder))
    {0: (1, 2, 3), 1: (0,)}
"""

from attnreg.heads import (
    PRUNED_HEADS,
    SILENCED_HEADS,
    HeadSpec,
    PruneReport,
    SlicedTensor,
    head_numbers,
    pruned_heads,
    silenced_heads,
    to_original_numbers,
)
from attnreg.methods.pruning.checkpoints import FOLDED_GATES, add_pruning_to_checkpoint, restore_pruning
from attnreg.methods.pruning.gates import (
    HardConcreteGate,
    fold_gates,
    gate_parameters,
    hard_concrete,
    make_hard_concrete,
)
from attnreg.methods.pruning.importance import (
    LossFunction,
    PruningStep,
    head_importance,
    iterative_pruning,
    select_groups,
    select_heads,
)
from attnreg.methods.pruning.optimizer_state import drop_from_optimizer, slice_optimizer_state
from attnreg.methods.pruning.saving import (
    SPEC_FILE,
    load_pruned,
    restore_saved_pruning,
    save_adapters,
    save_pruned,
    write_spec,
)
from attnreg.methods.pruning.surgery import SILENCE, check_removable, count_parameters, prune_heads, silence_heads

__all__ = [
    "FOLDED_GATES",
    "PRUNED_HEADS",
    "SILENCE",
    "SILENCED_HEADS",
    "SPEC_FILE",
    "HardConcreteGate",
    "HeadSpec",
    "LossFunction",
    "PruneReport",
    "PruningStep",
    "SlicedTensor",
    "add_pruning_to_checkpoint",
    "check_removable",
    "count_parameters",
    "drop_from_optimizer",
    "fold_gates",
    "gate_parameters",
    "hard_concrete",
    "head_importance",
    "head_numbers",
    "iterative_pruning",
    "load_pruned",
    "make_hard_concrete",
    "prune_heads",
    "pruned_heads",
    "restore_pruning",
    "restore_saved_pruning",
    "save_adapters",
    "save_pruned",
    "select_groups",
    "select_heads",
    "silence_heads",
    "silenced_heads",
    "slice_optimizer_state",
    "to_original_numbers",
    "write_spec",
]
