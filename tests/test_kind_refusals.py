"""A prior kind that would train nothing is refused on the paths users take, not only by `check_priors` by hand
(issue 39): a relation that never occurs in the training file, or a kind a decoder cannot reach, fails at the first
batch of a real `Trainer` / Lightning run, naming the relation and the file, before any optimizer step; a relation
absent from the first batches but present in the file trains; a head outside the model is refused naming its kind;
sentences of no file cannot be checked whole, and the method says when a kind has had no row to train on.
Hand-made trees, tiny decoders."""

import re

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import attnreg
from attnreg import methods
from attnreg.app.task import build_tokenizer
from attnreg.integrations.hf import AttnRegTrainer
from attnreg.syntax import Sentence, SyntaxCollator, SyntaxDataset
from attnreg.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# (word, relation, 1-based head) per word; no sentence has an auxiliary
WITHOUT_AUX = [
    [("The", "det", 3), ("old", "amod", 3), ("keys", "nsubj", 4), ("rattle", "root", 0), (".", "punct", 4)],
    [("A", "det", 2), ("dog", "nsubj", 3), ("barks", "root", 0), (".", "punct", 3)],
    [("The", "det", 2), ("cats", "nsubj", 3), ("sleep", "root", 0), ("here", "advmod", 3), (".", "punct", 3)],
    [("Old", "amod", 2), ("dogs", "nsubj", 3), ("bark", "root", 0), (".", "punct", 3)],
    [("The", "det", 2), ("key", "nsubj", 3), ("rattles", "root", 0), (".", "punct", 3)],
    [("A", "det", 3), ("old", "amod", 3), ("cat", "nsubj", 4), ("sleeps", "root", 0), (".", "punct", 4)],
]
WITH_AUX = [("Dogs", "nsubj", 3), ("can", "aux", 3), ("bark", "root", 0), (".", "punct", 3)]  # bark -> can: left
WORDS = sorted({word for sentence in [*WITHOUT_AUX, WITH_AUX] for word, _, _ in sentence})
AUX_KEY = "attnreg_prior.dependents:aux"


def write_conllu(path, sentences) -> str:
    blocks = []
    for number, words in enumerate(sentences):
        text = " ".join(word for word, _, _ in words)
        rows = [
            f"{i + 1}\t{word}\t_\tX\t_\t_\t{head}\t{relation}\t_\t_" for i, (word, relation, head) in enumerate(words)
        ]
        blocks.append("\n".join([f"# sent_id = s{number}", f"# text = {text}", *rows]) + "\n")
    path.write_text("\n".join(blocks) + "\n")
    return str(path)


def in_memory(sentences) -> list[Sentence]:
    """The trees as Sentences of no file (built in memory, as from a `datasets` table)."""
    out = []
    for number, words in enumerate(sentences):
        forms, relations, heads = zip(*words, strict=True)
        out.append(Sentence(f"s{number}", forms, heads, relations, " ".join(forms)))
    return out


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(WORDS)


def decoder(tokenizer):
    return tiny_model("llama", head="causal_lm", vocab=len(tokenizer))


def collator(tokenizer, kl, **options) -> SyntaxCollator:
    return SyntaxCollator(tokenizer, prior=None, kinds=kl.kind_priors, causal=True, lm_labels=True, **options)


def parameters(model) -> list[torch.Tensor]:
    return [parameter.detach().clone() for parameter in model.parameters()]


def unchanged(model, before) -> bool:
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


# -- the Hugging Face Trainer -----------------------------------------------------------------------------------------
def hf_trainer(tmp_path, model, dataset, collate, kl, max_steps=2) -> AttnRegTrainer:
    from transformers import TrainingArguments

    arguments = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=max_steps,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return AttnRegTrainer(model=model, args=arguments, train_dataset=dataset, data_collator=collate, methods=[kl])


@pytest.mark.parametrize(
    ("kinds", "message"),
    [
        ({"nsubj": {1: [0]}, "aux": {1: [1]}}, r"relation 'aux' never occurs in the 6 sentences of {file}"),
        (
            {"nsubj": {1: [0]}, "parent:det": {1: [1]}},  # a determiner's noun is to its right: nothing to the left
            r"'attnreg_prior.parent:det' \(parent:det\): none of its 5 rows in the 6 sentences of {file} .* has a "
            r"target at or before its word, so a causal model",
        ),
    ],
)
def test_trainer_refuses_a_kind_that_would_train_nothing_before_any_step(tmp_path, tokenizer, kinds, message):
    path = write_conllu(tmp_path / "train.conllu", WITHOUT_AUX)
    model = decoder(tokenizer)
    before = parameters(model)
    kl = methods.SyntaxPriorKL(kinds=kinds)
    trainer = hf_trainer(tmp_path, model, SyntaxDataset.from_conllu(path), collator(tokenizer, kl), kl)
    with pytest.raises(ValueError, match=message.format(file=re.escape(path))):
        trainer.train()
    assert trainer.state.global_step == 0 and unchanged(model, before)


def test_trainer_trains_a_relation_that_only_later_batches_hold(tmp_path, tokenizer):
    """One sentence of seven has an auxiliary: most batches have none (in any order), the file has one."""
    path = write_conllu(tmp_path / "train.conllu", [*WITHOUT_AUX, WITH_AUX])
    kl = methods.SyntaxPriorKL(kinds={"nsubj": {1: [0]}, "aux": {1: [1]}})
    trainer = hf_trainer(tmp_path, decoder(tokenizer), SyntaxDataset.from_conllu(path), collator(tokenizer, kl), kl, 4)
    trainer.train()
    assert trainer.state.global_step == 4


def test_trainer_refuses_a_head_outside_the_model_naming_its_kind(tmp_path, tokenizer):
    path = write_conllu(tmp_path / "train.conllu", [*WITHOUT_AUX, WITH_AUX])
    kl = methods.SyntaxPriorKL(kinds={"nsubj": {1: [0]}, "aux": {1: [9]}})  # the tiny Llama has 4 heads
    with pytest.raises(IndexError, match=r"kinds\['dependents:aux'\]: .*out of range for layer 1, which has 4 heads"):
        hf_trainer(tmp_path, decoder(tokenizer), SyntaxDataset.from_conllu(path), collator(tokenizer, kl), kl).train()


# -- Lightning --------------------------------------------------------------------------------------------------------
class LanguageModel(attnreg.AttnRegMixin, L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss  # the mixin takes the prior keys out of the batch

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Figures(L.Callback):
    """The aux kind's logged KL after every step."""

    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(trainer.callback_metrics[f"attnreg/syntax_prior_kl/{AUX_KEY[14:]}/layer1"]))


def lightning_fit(module, loader, callbacks, max_steps) -> L.Trainer:
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, loader)
    return trainer


def test_lightning_refuses_a_relation_absent_from_the_file_before_any_step(tmp_path, tokenizer):
    path = write_conllu(tmp_path / "train.conllu", WITHOUT_AUX)
    kl = attnreg.SyntaxPriorKL(kinds={"nsubj": {1: [0]}, "aux": {1: [1]}})
    module = LanguageModel(decoder(tokenizer))
    before = parameters(module)
    loader = DataLoader(SyntaxDataset.from_conllu(path), batch_size=2, collate_fn=collator(tokenizer, kl.method))
    with pytest.raises(ValueError, match=rf"relation 'aux' never occurs in the 6 sentences of {re.escape(path)}"):
        lightning_fit(module, loader, [kl], max_steps=2)
    assert unchanged(module, before)


def test_lightning_trains_a_relation_absent_from_the_first_batches(tmp_path, tokenizer):
    """In file order the auxiliary comes in the last batch: the first three have no row of it, and train on."""
    path = write_conllu(tmp_path / "train.conllu", [*WITHOUT_AUX, WITH_AUX, WITHOUT_AUX[0]])
    kl = attnreg.SyntaxPriorKL(kinds={"nsubj": {1: [0]}, "aux": {1: [1]}})
    figures = Figures()
    loader = DataLoader(SyntaxDataset.from_conllu(path), batch_size=2, collate_fn=collator(tokenizer, kl.method))
    lightning_fit(LanguageModel(decoder(tokenizer)), loader, [kl, figures], max_steps=4)
    assert figures.values[:3] == [0.0, 0.0, 0.0] and figures.values[3] > 0


def test_sentences_of_no_file_train_and_the_method_says_a_kind_had_no_row(tmp_path, tokenizer):
    """Without a file the data is not known whole (nothing is refused); the method warns after `quiet_batches`
    micro-batches without a row of the kind, and at the end that it trained nothing."""
    kl = attnreg.SyntaxPriorKL(kinds={"nsubj": {1: [0]}, "aux": {1: [1]}})
    kl.method._kinds["dependents:aux"].quiet_batches = 2
    loader = DataLoader(SyntaxDataset(in_memory(WITHOUT_AUX)), batch_size=2, collate_fn=collator(tokenizer, kl.method))
    quiet = r"'syntax_prior_kl/dependents:aux': no word of batch\['attnreg_prior.dependents:aux'\] had a target at or"
    with pytest.warns(UserWarning, match=rf"{quiet} .* in the first 2 training micro-batches: its term has been 0"):
        with pytest.warns(UserWarning, match=rf"{quiet} .* in the whole run \(3 micro-batches\): it trained nothing"):
            trainer = lightning_fit(LanguageModel(decoder(tokenizer)), loader, [kl], max_steps=3)
    assert trainer.global_step == 3


def test_check_kinds_false_lets_a_file_without_the_relation_train(tmp_path, tokenizer):
    """For data that mixes in other files where the relation occurs (the collator sees one file first)."""
    path = write_conllu(tmp_path / "train.conllu", WITHOUT_AUX)
    kl = attnreg.SyntaxPriorKL(kinds={"nsubj": {1: [0]}, "aux": {1: [1]}})
    collate = collator(tokenizer, kl.method, check_kinds=False)
    loader = DataLoader(SyntaxDataset.from_conllu(path), batch_size=2, collate_fn=collate)
    with pytest.warns(UserWarning, match="it trained nothing"):
        assert lightning_fit(LanguageModel(decoder(tokenizer)), loader, [kl], max_steps=2).global_step == 2
