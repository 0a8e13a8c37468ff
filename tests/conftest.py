import copy

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import attnreg
from attnreg.tiny import tiny_model

# The families the older, feature-by-feature tests run on (their expectations are written for these layouts); every
# family of attnreg.families.FAMILIES runs through tests/test_families.py's conformance test and tests/test_windows.py.
FAMILIES = ["bert", "roberta", "electra", "distilbert", "gpt2", "llama", "qwen2", "mistral"]
DECODERS = {"gpt2", "llama", "qwen2", "mistral"}


def padded_batch(batch: int = 3, length: int = 9, vocab: int = 99, seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids (avoiding the special ids 0-2) with right padding on all rows but the first."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):
        attention_mask[row, length - 2 * row :] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def main_output(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for every test module (autouse; the thread count is restored after the module): the tests'
    tiny models run fastest on one, and on two threads of a busy 2-core machine many times slower
    (tests/test_mixin.py, test_callbacks.py, test_analysis.py, test_hub.py together: 92-237 s on two threads,
    6-16 s on one, interleaved runs). Subprocesses (the distributed tests) set their own."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def model_pair(family):
    """(attached model, untouched SDPA copy with the same weights)."""
    model = tiny_model(family).eval()
    reference = copy.deepcopy(model)
    attnreg.attach(model)
    return model, reference


def eager_copy(model):
    reference = copy.deepcopy(model)
    if getattr(reference, "_attnreg_hub", None) is not None:
        attnreg.detach(reference)
    reference.set_attn_implementation("eager")
    return reference


class Classifier(attnreg.AttnRegMixin, L.LightningModule):
    """What a user writes: a LightningModule with the mixin around a transformers model, trained with Adam."""

    def __init__(self, model, lr=1e-2):
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def fit(module, batches, callbacks=()) -> L.Trainer:
    """A real, quiet Lightning fit on CPU: one step per batch in `batches` (already collated)."""
    trainer = L.Trainer(
        max_steps=len(batches),
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    trainer.fit(module, DataLoader(batches, batch_size=None))
    return trainer


def trainer(tmp_path, max_steps, callbacks, **options) -> L.Trainer:
    """A real, quiet Lightning trainer on CPU that checkpoints into `tmp_path` (for resuming tests)."""
    return L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=callbacks,
        **options,
    )


def sgd_arguments(output_dir, **options):
    """`TrainingArguments` for comparing runs exactly: plain SGD at a constant rate, no clipping, no saving, CPU."""
    from transformers import TrainingArguments

    defaults = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return TrainingArguments(**(defaults | options))
