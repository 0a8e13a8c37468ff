"""What was done to a model's shape, below the methods: heads removed or silenced, gates and temperatures folded,
LoRA factors and optimizer state sliced along, and the one pair that writes this record beside any weights and
restores it before they load.

The model keeps what was done (`attnreg.heads`: `pruned_heads`, `silenced_heads` in its config, original head
numbers; the hub's gates; the gate values folded at a removal); `record` reads it into the one `StructureRecord`
(`record_of`) and is the pair: `write_record` beside any weights, `restore_record` before they load (from a folder,
a record, or a training checkpoint dict), refusing a record the weights contradict. One module per concern besides:
`surgery` (`prune_heads`, `silence_heads`), `gates` (folding, the gates' parameters, `HardConcreteGate`),
`optimizer_state`, `checkpoints` (the record's entries in a checkpoint dict) and `saving` (`save_pruned`/
`load_pruned`, and saves of a PEFT model whose base weights changed). The methods (`attnreg.methods.pruning`:
gating, importance, removal policies), the runner, both adapters, `attnreg-analyze`, the head view and the app all
go through these.

Example:
    >>> import tempfile
    >>> from attnreg.tiny import tiny_model
    >>> model = tiny_model("llama", head="causal_lm")           # 4 query heads, 2 key/value groups a layer
    >>> report = prune_heads(model, {0: [0, 1, 2]})               # group 0 goes; head 2 is silenced in place
    >>> report.removed, list(report.kept[0])
    ({0: (0, 1)}, [2])
    >>> same = load_pruned(save_pruned(model, tempfile.mkdtemp()))
    >>> pruned_heads(same), silenced_heads(same)
    ({0: (0, 1)}, {0: (2,)})
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
from attnreg.structure.checkpoints import add_pruning_to_checkpoint, model_structure, restore_pruning, restore_structure
from attnreg.structure.gates import (
    HardConcreteGate,
    fold_gates,
    folded_gates,
    gate_parameters,
    hard_concrete,
    make_hard_concrete,
)
from attnreg.structure.optimizer_state import drop_from_optimizer, slice_optimizer_state
from attnreg.structure.record import (
    FOLDED_GATES,
    RECORD_FILE,
    StructureRecord,
    model_identity,
    read_record,
    record_of,
    restore_record,
    write_record,
)
from attnreg.structure.saving import (
    SPEC_FILE,
    base_changed,
    keep_base_in_adapter_saves,
    load_pruned,
    restore_saved_pruning,
    save_adapters,
    save_pruned,
    write_spec,
)
from attnreg.structure.surgery import SILENCE, check_removable, count_parameters, prune_heads, silence_heads

__all__ = [
    "FOLDED_GATES",
    "PRUNED_HEADS",
    "SILENCE",
    "SILENCED_HEADS",
    "SPEC_FILE",
    "RECORD_FILE",
    "HardConcreteGate",
    "HeadSpec",
    "PruneReport",
    "SlicedTensor",
    "StructureRecord",
    "add_pruning_to_checkpoint",
    "base_changed",
    "check_removable",
    "count_parameters",
    "drop_from_optimizer",
    "fold_gates",
    "folded_gates",
    "gate_parameters",
    "hard_concrete",
    "head_numbers",
    "keep_base_in_adapter_saves",
    "load_pruned",
    "make_hard_concrete",
    "model_identity",
    "model_structure",
    "prune_heads",
    "pruned_heads",
    "read_record",
    "record_of",
    "restore_pruning",
    "restore_record",
    "restore_saved_pruning",
    "restore_structure",
    "save_adapters",
    "save_pruned",
    "silence_heads",
    "silenced_heads",
    "slice_optimizer_state",
    "to_original_numbers",
    "write_record",
    "write_spec",
]
