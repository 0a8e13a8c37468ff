"""Lightning is an extra: `import attnreg` and a method through the Hugging Face `Trainer` run where Lightning
cannot be imported (a `sys.meta_path` blocker in a fresh interpreter), and the adapter's names say what to install."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys, tempfile

    class NoLightning(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric"):
                raise ModuleNotFoundError(f"No module named {name!r}")

    sys.meta_path.insert(0, NoLightning())
    import torch
    import attnreg
    from transformers import TrainingArguments
    from attnreg import methods
    from attnreg.integrations.hf import AttnRegTrainer
    from attnreg.tiny import tiny_model

    ids = torch.randint(3, 99, (8, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "attention_mask": torch.ones(8, dtype=torch.long), "labels": row} for row in ids]
    args = TrainingArguments(tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=4, logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    model = tiny_model("llama", head="causal_lm")
    trainer = AttnRegTrainer(model=model, args=args, train_dataset=data,
                             methods=[methods.EntropyRegularizer(weight=1.0, mode="max")])
    trainer.train()
    logged = [log for log in trainer.state.log_history if "attnreg/entropy_regularizer" in log]
    assert len(logged) == 2, trainer.state.log_history
    assert not [name for name in sys.modules if "lightning" in name], sorted(sys.modules)
    try:
        attnreg.EntropyRegularizer
    except ImportError as error:
        print("refused:", error)
    """
)


def test_attnreg_and_the_trainer_run_without_lightning():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused: attnreg.EntropyRegularizer belongs to the Lightning adapter" in done.stdout
    assert "pip install 'attnreg[lightning]'" in done.stdout
