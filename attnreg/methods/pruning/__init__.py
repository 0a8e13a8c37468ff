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

The methods live here: `HeadGating` and its gate kinds and removal policies (`method`, `gate_kinds`), head
importance and `ImportanceRemoval` (`importance`: `head_importance`, `select_heads`, `iterative_pruning`). What they
do to the model's shape (`prune_heads`, `silence_heads`, folding, `save_pruned`/`load_pruned`, checkpoints) is owned
by `attnreg.structure`, below the methods, and re-exported here under the same names.

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

from attnreg.methods.pruning.importance import (
    LossFunction,
    PruningStep,
    head_importance,
    iterative_pruning,
    select_groups,
    select_heads,
)
from attnreg.structure import (
    FOLDED_GATES,
    PRUNED_HEADS,
    RECORD_FILE,
    SILENCE,
    SILENCED_HEADS,
    SPEC_FILE,
    HardConcreteGate,
    HeadSpec,
    PruneReport,
    SlicedTensor,
    StructureRecord,
    add_pruning_to_checkpoint,
    check_removable,
    count_parameters,
    drop_from_optimizer,
    fold_gates,
    gate_parameters,
    hard_concrete,
    head_numbers,
    load_pruned,
    make_hard_concrete,
    prune_heads,
    pruned_heads,
    read_record,
    record_of,
    restore_pruning,
    restore_record,
    restore_saved_pruning,
    save_adapters,
    save_pruned,
    silence_heads,
    silenced_heads,
    slice_optimizer_state,
    to_original_numbers,
    write_record,
    write_spec,
)

__all__ = [
    "FOLDED_GATES",
    "PRUNED_HEADS",
    "SILENCE",
    "SILENCED_HEADS",
    "RECORD_FILE",
    "SPEC_FILE",
    "HardConcreteGate",
    "HeadSpec",
    "LossFunction",
    "PruneReport",
    "PruningStep",
    "SlicedTensor",
    "StructureRecord",
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
    "read_record",
    "record_of",
    "restore_pruning",
    "restore_record",
    "restore_saved_pruning",
    "save_adapters",
    "save_pruned",
    "select_groups",
    "select_heads",
    "silence_heads",
    "silenced_heads",
    "slice_optimizer_state",
    "to_original_numbers",
    "write_record",
    "write_spec",
]
