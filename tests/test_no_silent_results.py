"""Combinations that used to give silently wrong results now work or stop with a clear error (issue 15)."""

import copy
import math
import tempfile
import warnings

import conftest
import lightning as L
import pytest
import torch
from conftest import fit, padded_batch, trainer
from torch.utils.data import DataLoader, IterableDataset
from transformers import AutoModelForSequenceClassification

import attnreg
from attnreg.methods import HardConcreteGates, L1Gates, Removal
from attnreg.mixin import EvalModeWarning
from attnreg.progress import TrainingLengthWarning
from attnreg.schedules import Constant, Linear, Warmup
from attnreg.tiny import tiny_model


class Classifier(conftest.Classifier):
    """Keeps every value it logs."""

    def __init__(self, model, lr=1e-2):
        super().__init__(model, lr)
        self.logged: dict[str, list[float]] = {}

    def log(self, name, value, *args, **kwargs):
        self.logged.setdefault(name, []).append(float(value))
        super().log(name, value, *args, **kwargs)


def batches(count, seed=0):
    items = []
    for index in range(count):
        batch = padded_batch(batch=4, length=8, seed=seed + index)
        batch["labels"] = (batch["input_ids"][:, 0] % 2).long()
        items.append(batch)
    return items


def classifier(family="bert", **options):
    return Classifier(tiny_model(family, head="classification", **options).train())


# -- two callbacks of one class -------------------------------------------------------------------------------
def test_two_regularizers_of_one_class_both_act():
    sharpen = attnreg.EntropyRegularizer(mode="min", layers=[0], weight=1.0)
    flatten = attnreg.EntropyRegularizer(mode="max", layers=[1], weight=1.0)
    module = classifier()
    fit(module, batches(2), [sharpen, flatten])
    assert (sharpen.method.name, flatten.method.name) == ("entropy_regularizer", "entropy_regularizer_2")
    assert (
        "attnreg/entropy_regularizer/layer0" in module.logged
        and "attnreg/entropy_regularizer_2/layer1" in module.logged
    )
    assert module.logged["attnreg/entropy_regularizer"][0] > 0 > module.logged["attnreg/entropy_regularizer_2"][0]
    assert sharpen.state_key != flatten.state_key


def test_two_callbacks_with_one_explicit_name_are_an_error():
    first = attnreg.EntropyRegularizer(name="ent", layers=[0])
    second = attnreg.SyntaxPriorKL(name="ent", layers=[1])
    with pytest.raises(
        ValueError, match="the name 'ent' is already held by another attnreg method or term; give each its own name="
    ):
        fit(classifier(), batches(1), [first, second])


def test_two_dropout_schedules_keep_separate_checkpoint_state():
    first = attnreg.AttentionDropoutSchedule(Linear(0.2, 0.0), layers=[0], name="drop0")
    second = attnreg.AttentionDropoutSchedule(Linear(0.1, 0.0), layers=[1], name="drop1")
    assert first.state_key != second.state_key


# -- resuming with a longer run ---------------------------------------------------------------------------------
def test_resume_with_more_steps_restretches_every_schedule(tmp_path):
    def callbacks():
        return [
            attnreg.LayerwiseLR(lr=1e-2, schedule=Linear(1.0, 0.0)),
            attnreg.AttentionDropoutSchedule(Linear(0.2, 0.0)),
            attnreg.EntropyRegularizer(weight=Linear(1.0, 0.0)),
        ]

    first = trainer(tmp_path, 4, callbacks())
    first.fit(classifier(), DataLoader(batches(4), batch_size=None))
    checkpoint = tmp_path / "at4.ckpt"
    first.save_checkpoint(checkpoint)

    resumed_callbacks = callbacks()
    module = classifier()
    seen = []

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, *args):
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            seen.append((trainer.global_step, lr, resumed_callbacks[2].current_weight()))

    resumed = trainer(tmp_path, 8, [*resumed_callbacks, Watch()])
    with pytest.warns(TrainingLengthWarning, match="re-stretched from 4 to 8 steps"):
        resumed.fit(module, DataLoader(batches(8), batch_size=None), ckpt_path=checkpoint)
    # Steps 4..7 of 8 follow Linear(1, 0) over the new length; never the old schedule's end value 0.
    assert [step for step, _, _ in seen] == [4, 5, 6, 7]
    for step, lr, weight in seen:
        assert lr == pytest.approx(1e-2 * (1 - step / 8))
        assert weight == pytest.approx(1 - step / 8)
    assert module.logged["attnreg/attention_dropout_schedule"] == pytest.approx(
        [0.2 * (1 - s / 8) for s in (4, 5, 6, 7)]
    )


def test_resume_with_the_same_length_does_not_warn(tmp_path):
    class SaveAt2(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:
                trainer.save_checkpoint(tmp_path / "at2.ckpt")

    first = trainer(tmp_path, 4, [attnreg.LayerwiseLR(lr=1e-2, schedule=Linear(1.0, 0.0)), SaveAt2()])
    first.fit(classifier(), DataLoader(batches(4), batch_size=None))
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainingLengthWarning)
        again = trainer(tmp_path, 4, [attnreg.LayerwiseLR(lr=1e-2, schedule=Linear(1.0, 0.0))])
        again.fit(classifier(), DataLoader(batches(4), batch_size=None), ckpt_path=tmp_path / "at2.ckpt")
    assert again.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0)  # the schedule's end, at its end


# -- unknown training length ----------------------------------------------------------------------------------
class Stream(IterableDataset):
    def __iter__(self):
        return iter(batches(3))


@pytest.mark.parametrize(
    "callback",
    [
        lambda: attnreg.EntropyRegularizer(weight=Warmup(0.5, Constant(1.0))),
        lambda: attnreg.AttentionDropoutSchedule(Linear(0.1, 0.0)),
        lambda: attnreg.HeadGating(gates=L1Gates(weight=Warmup(0.5, Constant(0.1)))),
        lambda: attnreg.LayerwiseLR(lr=1e-3, schedule=Linear(1.0, 0.0)),
    ],
    ids=["weight", "dropout", "gating", "lr"],
)
def test_a_schedule_without_a_known_length_is_refused(tmp_path, callback):
    run = trainer(tmp_path, -1, [callback()], max_epochs=1)
    with pytest.raises(ValueError, match="set max_steps"):
        run.fit(classifier(), DataLoader(Stream(), batch_size=None))


def test_a_constant_weight_needs_no_length(tmp_path):
    entropy = attnreg.EntropyRegularizer(weight=0.5)
    module = classifier()
    trainer(tmp_path, -1, [entropy], max_epochs=1).fit(module, DataLoader(Stream(), batch_size=None))
    assert len(module.logged["attnreg/entropy_regularizer"]) == 3


# -- a training step that returns None --------------------------------------------------------------------------
def test_a_step_returning_none_names_the_lost_terms():
    class NoLabels(Classifier):
        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"]).loss  # None: no labels

    with pytest.raises(
        RuntimeError, match=r"returned None, so attnreg's terms \['entropy_regularizer', 'syntax_prior_kl'\]"
    ):
        fit(
            NoLabels(tiny_model("bert", head="classification")),
            batches(1),
            [
                attnreg.EntropyRegularizer(layers=[0]),
                attnreg.SyntaxPriorKL(layers=[1]),
            ],
        )


# -- gates and layer-wise learning rates ------------------------------------------------------------------------
def test_gates_get_their_own_group_under_layerwise_lr():
    gating = attnreg.HeadGating(gates=L1Gates(weight=0.1), removal=Removal(keep=6))
    llrd = attnreg.LayerwiseLR(lr=1e-3, decay=0.5, multipliers={"gates": 100})
    seen = {}

    class Groups(L.Callback):
        def on_train_start(self, trainer, pl_module):
            for group in trainer.optimizers[0].param_groups:
                seen[group["name"]] = (group["lr"], [id(p) for p in group["params"]])
            seen["gates_expected"] = sorted(id(g) for g in attnreg.methods.pruning.gate_parameters(pl_module.model))

    fit(classifier(), batches(2), [gating, llrd, Groups()])
    assert seen["gates"][0] == pytest.approx(0.1)  # lr x 100, no layer decay
    assert sorted(seen["gates"][1]) == seen["gates_expected"]
    assert all(
        set(ids).isdisjoint(seen["gates_expected"]) for name, (_, ids) in seen.items() if name.startswith("layer")
    )


def test_sequence_classifier_gives_gates_their_own_rate():
    from attnreg.app.modules import SequenceClassifier

    gating = attnreg.HeadGating(gates=L1Gates(weight=0.1), removal=Removal(keep=6))
    module = SequenceClassifier(tiny_model("bert", head="classification"), lr=1e-3, gate_lr=0.05)
    trainer_ = fit(module, batches(2), [gating])
    groups = {group["name"]: group for group in trainer_.optimizers[0].param_groups}
    assert groups["gates"]["initial_lr"] == 0.05 and groups["decay"]["initial_lr"] == 1e-3


# -- saving an attached model -----------------------------------------------------------------------------------
def test_save_pretrained_on_an_attached_model_keeps_what_it_computes():
    model = tiny_model("gpt2", head="classification").eval()
    hub = attnreg.attach(model)
    with torch.no_grad():
        hub.gate(0)[1] = 0.0
        hub.gate(1).mul_(0.5)
    hub.set_temperature(torch.tensor([1.0, 2.0, 0.5, 3.0]), layers=[1])
    batch = padded_batch()
    expected = model(**batch).logits
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        reloaded = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    torch.testing.assert_close(reloaded(**batch).logits, expected, atol=1e-5, rtol=1e-5)
    assert set(hub.gates) == {0, 1}  # the model itself keeps its gates
    attnreg.detach(model)
    assert "save_pretrained" not in model.__dict__


# -- construction-time checks -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: attnreg.HeadGating(removal=Removal(threshold=-1)), "threshold must be a finite number > 0"),
        (lambda: attnreg.HeadGating(removal=Removal(threshold=0)), "threshold must be a finite number > 0"),
        (lambda: attnreg.HeadGating(gates=HardConcreteGates(lagrangian_lr=math.nan)), "lagrangian_lr"),
        (lambda: attnreg.AttentionDropoutSchedule(1.0), r"dropout rate must be in \[0, 1\)"),
        (lambda: attnreg.AttentionDropoutSchedule(0.1, hidden=1.5), r"dropout rate must be in \[0, 1\)"),
    ],
)
def test_arguments_that_cannot_work_fail_at_construction(build, message):
    with pytest.raises(ValueError, match=message):
        build()


# -- a layer pruned empty under an all-layer regularizer ------------------------------------------------------
def test_a_layer_pruned_empty_leaves_the_other_layers_regularized():
    entropy = attnreg.EntropyRegularizer(weight=1.0)
    gating = attnreg.HeadGating(gates=L1Gates(weight=0.01), removal=Removal(milestones=[(0.5, 4)]))
    module = classifier()
    with pytest.warns(UserWarning, match="every chosen head of layer [01] was pruned") as record:
        # heads of one layer are scored far below the other's, so the milestone empties that layer
        class Bias(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, *args):
                if trainer.global_step == 0:
                    with torch.no_grad():
                        pl_module.attnreg_hub.gates[1].fill_(0.01)

        fit(module, batches(4), [Bias(), gating, entropy])
    assert attnreg.attach(module.model).layers[1].num_heads == 0
    assert len([w for w in record if "head of layer 1 was pruned" in str(w.message)]) == 1  # said once
    assert len(module.logged["attnreg/entropy_regularizer"]) == 4 and all(
        math.isfinite(v) for v in module.logged["attnreg/entropy_regularizer"]
    )
    assert (
        len(module.logged["attnreg/entropy_regularizer/layer0"]) == 4
        and len(module.logged["attnreg/entropy_regularizer/layer1"]) == 2
    )


def test_supervised_heads_keep_their_original_numbers_after_pruning():
    model = tiny_model("bert", head="classification")
    attnreg.methods.pruning.prune_heads(model, {0: [0]})
    kl = attnreg.SyntaxPriorKL(layers=[0], heads=[2])
    module = Classifier(model.train())
    kl.setup(None, module, "fit")
    assert kl.method.active_heads() == {0: [1]}  # head 2 sits at position 1 once head 0 is gone


# -- the Lagrangian under gradient accumulation -------------------------------------------------------------------
def test_lagrangian_multipliers_take_one_step_per_optimizer_step():
    def multipliers(accumulate):
        gating = attnreg.HeadGating(gates=HardConcreteGates(lagrangian_lr=1.0), removal=Removal(keep=3))
        torch.manual_seed(0)
        module = classifier()
        trainer_ = L.Trainer(
            max_steps=2,
            accumulate_grad_batches=accumulate,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[gating],
        )
        steps = []

        class Watch(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, *args):
                steps.append(gating.method.lambdas.clone())

        trainer_.callbacks.append(Watch())
        trainer_.fit(module, DataLoader(batches(2 * accumulate), batch_size=None))
        return steps

    once, accumulated = multipliers(1), multipliers(2)
    assert len(accumulated) == 4
    assert torch.equal(accumulated[0], torch.zeros(2))  # no dual step after the first micro-batch
    assert accumulated[1][0] > 0 and torch.equal(accumulated[2], accumulated[1])
    assert accumulated[1][0] < 2 * once[0][0]  # one step of the mean gap, not two


# -- a model left in eval mode ---------------------------------------------------------------------------------
def test_a_model_in_eval_mode_is_reported_once():
    module = Classifier(tiny_model("bert", head="classification").eval())
    with pytest.warns(EvalModeWarning, match="eval mode.*model.train\\(\\) before trainer.fit") as record:
        fit(module, batches(3), [attnreg.EntropyRegularizer()])
    assert len([w for w in record if issubclass(w.category, EvalModeWarning)]) == 1


# -- torch.compile and a gate created after the first compiled call -----------------------------------------------
def test_a_gate_created_after_compiling_is_applied():
    model = tiny_model("bert", head="classification", layers=1).eval()
    hub = attnreg.attach(model)
    compiled = torch.compile(model)
    batch = padded_batch()
    before = compiled(**batch).logits
    with torch.no_grad():
        hub.gate(0)[:2] = 0.0
    after = compiled(**batch).logits
    torch.testing.assert_close(after, model(**batch).logits, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(after, before, atol=1e-4)


# -- what a resume repeats exactly --------------------------------------------------------------------------------
def test_a_resumed_run_repeats_the_schedules_and_state_of_the_uninterrupted_run(tmp_path):
    """Exact on resume: learning rates, dropout rates, loss weights, gates and optimizer state. Not restored:
    the data order inside a partly done epoch and the dropout RNG (see the README's Guarantees)."""

    def run(max_steps, checkpoint=None, save_at=None):
        torch.manual_seed(0)
        chosen = [
            attnreg.LayerwiseLR(lr=1e-2, decay=0.5, schedule=Warmup(0.3, Linear(1.0, 0.0))),
            attnreg.AttentionDropoutSchedule(Linear(0.2, 0.0)),
            attnreg.EntropyRegularizer(weight=Linear(1.0, 0.2)),
            attnreg.HeadGating(gates=L1Gates(weight=0.1), removal=Removal(keep=5)),
        ]
        seen = {}

        class Watch(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, *args):
                hub = pl_module.attnreg_hub
                seen[trainer.global_step] = (
                    [group["lr"] for group in trainer.optimizers[0].param_groups],
                    hub.attention_dropout(0),
                    chosen[2].current_weight(),
                )

            def on_train_batch_end(self, trainer, pl_module, *args):
                if trainer.global_step == save_at:
                    trainer.save_checkpoint(tmp_path / "mid.ckpt")
                    seen["state"] = {k: v.clone() for k, v in pl_module.model.state_dict().items()}
                    seen["optimizer"] = copy.deepcopy(trainer.optimizers[0].state_dict())

            def on_train_start(self, trainer, pl_module):
                seen["restored"] = {k: v.clone() for k, v in pl_module.model.state_dict().items()}
                seen["restored_optimizer"] = copy.deepcopy(trainer.optimizers[0].state_dict())

        module = classifier()
        trainer(tmp_path, max_steps, [*chosen, Watch()]).fit(
            module, DataLoader(batches(max_steps), batch_size=None), ckpt_path=checkpoint
        )
        return seen

    whole = run(6, save_at=3)
    resumed = run(6, checkpoint=tmp_path / "mid.ckpt")
    assert sorted(k for k in resumed if isinstance(k, int)) == [3, 4, 5]
    for step in (3, 4, 5):
        assert resumed[step] == whole[step]
    assert resumed["restored"].keys() == whole["state"].keys()
    for key, value in whole["state"].items():
        assert torch.equal(resumed["restored"][key], value), key  # gates included
    torch.testing.assert_close(resumed["restored_optimizer"]["state"], whole["optimizer"]["state"], rtol=0, atol=0)


# -- issue 38 -------------------------------------------------------------------------------------------
def test_the_app_finishes_and_reports_a_run_that_empties_a_layer(tmp_path):
    """38.5: `keep=4` with layer 0 protected on the default model (2 layers x 4 heads) empties layer 1; the summary
    crashed on it."""
    from hydra import compose, initialize_config_dir

    from attnreg.app.configs import CONFIG_DIR, register_resolvers
    from attnreg.app.summary import format_summary
    from attnreg.app.train import train
    from attnreg.heads import head_numbers
    from attnreg.methods.pruning import load_pruned

    register_resolvers()
    overrides = ["attnreg=[syntax_prior_kl,head_gating]", "attnreg.head_gating.removal.keep=4", "~logger"]
    overrides.append("attnreg.head_gating.removal.protect={0: [0, 1, 2, 3]}")  # layer 0 stays: layer 1 empties
    overrides.append("protect_supervised=false")  # L1H0, which the prior supervises, may go too
    small = ["data.train=64", "data.val=32", "data.test=32", "data.hard=32", "trainer.max_epochs=1"]
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("train", [*overrides, *small, "trainer.enable_progress_bar=false"])
    summary = train(cfg, tmp_path)
    emptied = [layer for layer, left in enumerate(summary["pruning"]["heads_left"]) if left == 0]
    assert emptied and sum(summary["pruning"]["heads_left"]) == 4
    assert all((value is None) == (layer in emptied) for layer, value in enumerate(summary["entropy"]))
    assert (tmp_path / "summary.json").is_file()
    pruned = load_pruned(tmp_path / "pruned_model")
    assert [len(head_numbers(pruned, layer)) for layer in range(2)] == summary["pruning"]["heads_left"]
    assert "removed" in format_summary(summary).splitlines()[3]  # the entropy line names the emptied layer


def test_analyze_refuses_a_checkpoint_that_would_run_code_unless_trusted(tmp_path):
    """38.6: a shared .ckpt is read with weights_only=True; one holding more is refused, --trust-checkpoint loads it."""
    from pathlib import Path

    from attnreg.app.analyze import main
    from attnreg.app.task import build_tokenizer, vocabulary

    tokenizer = build_tokenizer(vocabulary())
    tiny_model("bert", vocab=len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    words = [("the", 2, "det"), ("dogs", 3, "nsubj"), ("bark", 0, "root")]
    rows = [f"{i}\t{word}\t_\t_\t_\t_\t{head}\t{rel}\t_\t_" for i, (word, head, rel) in enumerate(words, 1)]
    (tmp_path / "dev.conllu").write_text("# text = the dogs bark\n" + "\n".join(rows) + "\n\n")
    classifier = tiny_model("bert", head="classification", vocab=len(tokenizer))
    state = {f"model.{key}": value for key, value in classifier.state_dict().items()}
    ran = tmp_path / "code-ran"

    class Payload:  # what a malicious checkpoint carries: unpickling it calls Path.touch(ran)
        def __reduce__(self):
            return Path.touch, (ran,)

    torch.save({"state_dict": state, "hyper_parameters": {"lr": 1e-3, "payload": Payload()}}, tmp_path / "run.ckpt")
    args = [str(tmp_path / "run.ckpt"), str(tmp_path / "dev.conllu"), "--base", str(tmp_path / "base"), "--no-plots"]
    with pytest.raises(SystemExit) as stop:
        main([*args, "--out", str(tmp_path / "refused")])
    assert stop.value.code == 2 and not ran.exists()
    assert main([*args, "--out", str(tmp_path / "trusted"), "--trust-checkpoint"]) == 0 and ran.exists()
    torch.save({"state_dict": state, "hyper_parameters": {"lr": 1e-3, "dir": tmp_path}}, tmp_path / "plain.ckpt")
    assert main([str(tmp_path / "plain.ckpt"), *args[1:], "--out", str(tmp_path / "plain")]) == 0  # a path is fine


def test_the_refusal_of_an_unsafe_checkpoint_names_what_it_holds_and_the_opt_in(tmp_path):
    from pathlib import Path

    from attnreg.app.analyze import InputError, _from_checkpoint

    torch.save(
        {"state_dict": {}, "hyper_parameters": {"when": __import__("datetime").date(2026, 1, 1)}}, tmp_path / "a.ckpt"
    )
    with pytest.raises(
        InputError, match=r"a.ckpt holds more than weights and plain data \(datetime.date\).*--trust-checkpoint"
    ):
        _from_checkpoint(Path(tmp_path / "a.ckpt"), "unused")

    for content in (b"", b"not a torch.save file"):  # empty or foreign: a clear refusal, not a traceback
        (tmp_path / "b.ckpt").write_bytes(content)
        with pytest.raises(InputError, match="b.ckpt is not a readable PyTorch checkpoint"):
            _from_checkpoint(Path(tmp_path / "b.ckpt"), "unused")
