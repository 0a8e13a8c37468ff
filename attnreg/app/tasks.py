"""The kinds of task the training app runs, one object each: sentence classification (`ClassificationTask`), causal LM
(`LanguageModelTask`) and chat SFT (`ChatTask`). `task_of(cfg)` chooses one from the data config, once: its class's
`task` name (`attnreg.app.datamodules.AppDataModule.task`). The app then asks the task for whatever differs by kind:
its data module, its model (refusing one that does not fit it), its LightningModule, its LoRA adapter, its numbers for
the summary (`attnreg.app.summary.summarize`) and its summary lines (`attnreg.app.summary.format_summary`).

Example:
    >>> from omegaconf import OmegaConf
    >>> task_of(OmegaConf.create({"data": {"_target_": "attnreg.app.lm.HubChatDataModule"}}))
    ChatTask()
    >>> [(name, task.peft_task_type, task.generates) for name, task in TASKS.items()]
    [('classification', 'SEQ_CLS', False), ('causal_lm', 'CAUSAL_LM', True), ('chat', 'CAUSAL_LM', True)]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hydra.utils import get_object, instantiate
from omegaconf import DictConfig
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from attnreg.app.decoder_evaluation import decoder_head_report, greedy_continuations, perplexity
from attnreg.app.evaluation import accuracy, head_report
from attnreg.app.models import add_lora, decoder_family


class Task:
    """What the app does differently by kind of task; the base holds what every kind does alike. `name` is the data
    modules' `task` and a decoder summary's "task"; `peft_task_type` the LoRA adapter's; `generates`: a causal LM,
    whose pruning run keeps the model as built to measure generation speed against (and may recover it as a
    control); `named_in_summary`: the summary says the task (a classification summary, older than the others, does
    not).

    Example:
        >>> from attnreg.app.datamodules import AgreementDataModule
        >>> from attnreg.app.models import tiny_classifier
        >>> data = AgreementDataModule(train=8, val=4, test=4, hard=2); data.setup("fit")
        >>> sorted(CLASSIFICATION.scores(tiny_classifier(data.tokenizer, num_labels=2), data)["accuracy"])
        ['hard', 'test', 'val']
    """

    name: str
    peft_task_type: str
    generates = False
    named_in_summary = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # -- building the run ------------------------------------------------------------------------------------------
    def data(self, cfg: DictConfig, tokenizer: PreTrainedTokenizerBase | None, with_prior: bool) -> Any:
        """The data module of `cfg.data`, on `tokenizer` (a pretrained model's; None: the data builds its own)."""
        return instantiate(cfg.data, tokenizer=tokenizer, with_prior=with_prior)

    def model(self, cfg: DictConfig, data: Any) -> PreTrainedModel:
        """The model of `cfg.model` sized for `data`, refused (naming both) when it does not fit this task."""
        self.check_model_config(cfg)
        model = instantiate(cfg.model, tokenizer=data.tokenizer, num_labels=data.num_labels)
        self.check_model(model, cfg)
        return model

    def check_model_config(self, cfg: DictConfig) -> None:
        """Refuse, before it loads, a model config that cannot fit this task (none here)."""

    def check_model(self, model: PreTrainedModel, cfg: DictConfig) -> None:
        """Refuse a model (or the module config around it) that does not fit this task; each task defines it."""
        raise NotImplementedError(f"{type(self).__name__} must define check_model()")

    def module(self, cfg: DictConfig, model: Any) -> Any:
        """The LightningModule of `cfg.module` training `model`."""
        return instantiate(cfg.module, model=model)

    def add_lora(self, model: PreTrainedModel, cfg: DictConfig) -> Any:
        """`model` in the LoRA adapter `cfg.peft` describes (`attnreg.app.models.add_lora`), of this task's type."""
        return add_lora(model, **cfg.peft, seed=cfg.seed, task_type=self.peft_task_type)

    # -- the summary -----------------------------------------------------------------------------------------------
    def scores(self, model: PreTrainedModel, data: Any) -> dict[str, Any]:
        """The task's numbers on held-out data, summary entries by name; each task defines it."""
        raise NotImplementedError(f"{type(self).__name__} must define scores()")

    def parent_accuracy(
        self, model: PreTrainedModel, data: Any, sentences: list[Any], supervised: Mapping[int, Any]
    ) -> dict[str, Any]:
        """The parent accuracy of the `supervised` heads and the best one on `sentences`; each task defines it."""
        raise NotImplementedError(f"{type(self).__name__} must define parent_accuracy()")

    def generations(self, model: PreTrainedModel, data: Any, cfg: DictConfig) -> dict[str, Any]:
        """What the model writes, summary entries by name (nothing here)."""
        return {}

    def summary_lines(self, summary: Mapping[str, Any]) -> list[str]:
        """The summary's lines between the callbacks and the saved models: the task's results, then the pruning."""
        pruning = summary.get("pruning")
        return [*self.result_lines(summary), *(self.pruning_lines(pruning) if pruning else ["heads pruned: none"])]

    def result_lines(self, summary: Mapping[str, Any]) -> list[str]:
        """The lines of the task's numbers, parent accuracy and prior; each task defines them."""
        raise NotImplementedError(f"{type(self).__name__} must define result_lines()")

    def pruning_lines(self, pruning: Mapping[str, Any]) -> list[str]:
        """The lines of the heads a run removed; each task defines them."""
        raise NotImplementedError(f"{type(self).__name__} must define pruning_lines()")


class ClassificationTask(Task):
    """Sentence classification: a sequence classifier, accuracy on each of the data's `eval_sets()`, parent accuracy
    beside the right-branching baseline (the left-branching one for a causal classifier).

    Example:
        >>> summary = {"accuracy": {"val": 0.9, "test": 0.875}, "entropy": [0.61, 0.42], "pruning": None}
        >>> print("\\n".join(CLASSIFICATION.summary_lines(summary)))
        accuracy: val 0.900, test 0.875
        attention entropy per layer (normalized): 0.610, 0.420
        heads pruned: none
    """

    name = "classification"
    peft_task_type = "SEQ_CLS"  # the new classification head trains too

    def check_model(self, model: PreTrainedModel, cfg: DictConfig) -> None:
        """Refuse a causal LM: it would be trained with a random classification head.

        Example:
            >>> from attnreg.tiny import tiny_model
            >>> CLASSIFICATION.check_model(tiny_model("llama", head="causal_lm"), None)
            Traceback (most recent call last):
            ...
            ValueError: model LlamaForCausalLM is a causal LM and the data is a classification task: it would be ...
        """
        if is_causal_lm(model):
            raise ValueError(
                f"model {type(model).__name__} is a causal LM and the data is a classification task: it would be "
                "trained with a random classification head. Choose a decoder task (data=agreement_lm, ewt_lm, "
                "text_lm, hf_lm or chat) or a classifier model config"
            )

    def scores(self, model: PreTrainedModel, data: Any) -> dict[str, Any]:
        return {"accuracy": {name: round(accuracy(model, loader), 4) for name, loader in data.eval_sets().items()}}

    def parent_accuracy(
        self, model: PreTrainedModel, data: Any, sentences: list[Any], supervised: Mapping[int, Any]
    ) -> dict[str, Any]:
        return head_report(model, data.tokenizer, sentences, supervised, data.max_length)

    def result_lines(self, summary: Mapping[str, Any]) -> list[str]:
        lines = [
            "accuracy: " + ", ".join(f"{name} {value:.3f}" for name, value in summary["accuracy"].items()),
            "attention entropy per layer (normalized): " + ", ".join(_fraction(value) for value in summary["entropy"]),
        ]
        if "hard" in summary["accuracy"]:
            lines[0] += "  (test: 0-1 distractor verbs as in training; hard: 2)"
        heads = summary.get("parent_accuracy")
        if heads:
            supervised = _supervised(heads, summary.get("pruning"))
            if "right_branching" in heads:
                baseline = f"right-branching {heads['right_branching']:.3f}"
            else:  # a causal classifier: accuracy over the parents to the left, the only ones its heads can attend to
                baseline = (
                    f"left-branching {heads['left_branching']:.3f} (a decoder: over the "
                    f"{heads['reachable_share']:.1%} of words whose parent is to their left)"
                )
            lines.append(
                f"parent accuracy on {heads['sentences']} held-out sentences: supervised {supervised}; "
                f"best head {heads['best_head']} {_fraction(heads['best'])}; {baseline}"
            )
        arcs = summary.get("prior_arcs")
        if arcs and arcs["arcs"]:
            lines.append(
                f"syntax prior: {arcs['arcs']} arcs in {arcs['sentences']} sentences, {arcs['arcs_dropped']} without "
                f"a prior ({arcs['arcs_dropped'] / arcs['arcs']:.1%}: truncated, or sharing a token)"
            )
        if arcs and arcs.get("causal_rows"):
            dropped, rows = arcs["causal_rows_dropped"], arcs["causal_rows"]
            lines.append(
                f"causal restriction: {dropped} of {rows} prior rows left out ({dropped / rows:.1%}: the parent is "
                "to the right, which a decoder cannot attend to)"
            )
        return lines

    def pruning_lines(self, pruning: Mapping[str, Any]) -> list[str]:
        removed = "; ".join(f"layer {layer}: {heads}" for layer, heads in pruning["removed"].items()) or "none removed"
        return [
            f"heads pruned: {removed}{_silenced(pruning)} (heads left per layer {pruning['heads_left']}, saved to "
            f"{pruning.get('saved')})"
        ]


class LanguageModelTask(Task):
    """Causal LM: a causal-LM model trained by `attnreg.app.modules.CausalLM`, validation perplexity, parent accuracy
    over the words whose parent is to their left, greedy continuations of the data's prompts, and for a pruned model
    its parameters and generation speed against the model as built.

    Example:
        >>> summary = {"perplexity": {"val": 12.5}, "continuations": {"the dog": "sees a cat"}, "pruning": None}
        >>> print("\\n".join(LANGUAGE_MODEL.summary_lines(summary)))
        validation perplexity: 12.50
        heads pruned: none
        greedy: 'the dog' -> 'sees a cat'
    """

    name = "causal_lm"
    peft_task_type = "CAUSAL_LM"
    generates = True
    named_in_summary = True
    chat = False
    """Whether prompts are given as a user's turn in the tokenizer's chat template (`greedy_continuations`)."""

    def check_model_config(self, cfg: DictConfig) -> None:
        """Refuse a classifier's model config before it loads.

        Example:
            >>> from omegaconf import OmegaConf
            >>> LANGUAGE_MODEL.check_model_config(OmegaConf.create({"model": {"_target_": "m.tiny_classifier"}}))
            Traceback (most recent call last):
            ...
            ValueError: data is a causal_lm task but the model config builds a sequence classifier (m.tiny_cl...
        """
        if cfg.model._target_.endswith("_classifier"):
            raise ValueError(
                f"data is a {self.name} task but the model config builds a sequence classifier ({cfg.model._target_}):"
                " choose model=tiny_llama_lm, model=decoder model.name_or_path=DIR or model=smollm2 (it is not a "
                "causal LM)"
            )

    def check_model(self, model: PreTrainedModel, cfg: DictConfig) -> None:
        """Refuse a model that is no causal LM, and a module config that is not `attnreg.app.modules.CausalLM`.

        Example:
            >>> from omegaconf import OmegaConf
            >>> from attnreg.tiny import tiny_model
            >>> cfg = OmegaConf.create({"module": {"_target_": "attnreg.app.modules.SequenceClassifier"}})
            >>> CHAT.check_model(tiny_model("llama", head="causal_lm"), cfg)
            Traceback (most recent call last):
            ...
            ValueError: data is a chat task: module._target_ must be attnreg.app.modules.CausalLM
        """
        if not is_causal_lm(model):
            raise ValueError(
                f"data is a {self.name} task but model {type(model).__name__} is not a causal LM: choose "
                "model=tiny_llama_lm, model=decoder model.name_or_path=DIR or model=smollm2"
            )
        if not cfg.module._target_.endswith("CausalLM"):
            raise ValueError(f"data is a {self.name} task: module._target_ must be attnreg.app.modules.CausalLM")

    def scores(self, model: PreTrainedModel, data: Any) -> dict[str, Any]:
        scores = perplexity(model, data.loader("val"))
        return {
            "perplexity": {"val": scores["perplexity"]},
            "loss": {"val": scores["loss"]},
            "predicted_tokens": {"val": scores["tokens"]},
        }

    def parent_accuracy(
        self, model: PreTrainedModel, data: Any, sentences: list[Any], supervised: Mapping[int, Any]
    ) -> dict[str, Any]:
        return decoder_head_report(model, data.tokenizer, sentences, supervised, data.max_length)

    def generations(self, model: PreTrainedModel, data: Any, cfg: DictConfig) -> dict[str, Any]:
        """Greedy continuations of the data's prompts, `cfg.generate_tokens` long (16 by default)."""
        tokens = cfg.get("generate_tokens", 16)
        return {"continuations": greedy_continuations(model, data.tokenizer, data.prompts, tokens, chat=self.chat)}

    def summary_lines(self, summary: Mapping[str, Any]) -> list[str]:
        greedy = [f"greedy: {prompt!r} -> {text!r}" for prompt, text in (summary.get("continuations") or {}).items()]
        return [*super().summary_lines(summary), *greedy]

    def result_lines(self, summary: Mapping[str, Any]) -> list[str]:
        lines = [f"validation perplexity: {summary['perplexity']['val']:.2f}"]
        heads = summary.get("parent_accuracy")
        if heads:
            supervised = _supervised(heads, summary.get("pruning"))
            lines.append(
                f"parent accuracy over the {heads['left_parent_share']:.1%} of words whose parent is to their left "
                f"({heads['sentences']} held-out sentences): supervised {supervised}; best head {heads['best_head']} "
                f"{_fraction(heads['best'])}; best left offset ({heads['best_offset']}) "
                f"{heads['best_offset_accuracy']:.3f}"
            )
        arcs = summary.get("prior_arcs")
        if arcs and arcs.get("causal_rows"):
            dropped, rows = arcs["causal_rows_dropped"], arcs["causal_rows"]
            used = rows - dropped
            lines.append(f"syntax prior: {used} of {rows} prior rows used (the others' parent is to the right)")
        return lines

    def pruning_lines(self, pruning: Mapping[str, Any]) -> list[str]:
        """The heads removed, the parameters and generation speed against the unpruned model, and the control run.

        Example:
            >>> pruning = {"removed": {"1": [0, 1]}, "heads_left": [4, 2], "parameters": 900,
            ...            "generation": {"pruned": {"tokens_per_second": 120.0, "parameters": 900},
            ...                           "unpruned": {"tokens_per_second": 100.0, "parameters": 1000}},
            ...            "speedup": 1.2}
            >>> print(LANGUAGE_MODEL.pruning_lines(pruning)[0])
            heads pruned: 2 (layer 1: [0, 1]); 900 parameters against 1000; generation 120.0 tokens/s against 100.0 ...
        """
        count = sum(len(heads) for heads in pruning["removed"].values())
        removed = "; ".join(f"layer {layer}: {heads}" for layer, heads in pruning["removed"].items())
        line = f"heads pruned: {count} ({removed}){_silenced(pruning)}; {pruning['parameters']} parameters"
        speed = pruning.get("generation")
        if speed:
            line += (
                f" against {speed['unpruned']['parameters']}; generation {speed['pruned']['tokens_per_second']} "
                f"tokens/s against {speed['unpruned']['tokens_per_second']} unpruned ({pruning['speedup']:.2f}x)"
            )
        lines = [line]
        control = pruning.get("control")
        if control:
            lines.append(
                f"unpruned control, recovered the same way ({control['steps']} steps): validation perplexity "
                f"{control['perplexity']:.2f}; the pruned model's is {control['ratio']:.3f}x it"
            )
        return lines


class ChatTask(LanguageModelTask):
    """Chat SFT: a causal LM as `LanguageModelTask`'s, its prompts continued as a user's turn in the chat template.

    Example:
        >>> CHAT.name, CHAT.chat, CHAT.peft_task_type
        ('chat', True, 'CAUSAL_LM')
    """

    name = "chat"
    chat = True


CLASSIFICATION, LANGUAGE_MODEL, CHAT = ClassificationTask(), LanguageModelTask(), ChatTask()
TASKS: dict[str, Task] = {task.name: task for task in (CLASSIFICATION, LANGUAGE_MODEL, CHAT)}
"""The task of each name (a data module's `task`, a summary's "task")."""


def task_named(name: str) -> Task:
    """The task called `name` (see `TASKS`).

    Example:
        >>> task_named("causal_lm"), task_named("tagging")
        Traceback (most recent call last):
        ...
        ValueError: no task is called 'tagging': the app's tasks are classification, causal_lm, chat
    """
    if name not in TASKS:
        raise ValueError(f"no task is called {name!r}: the app's tasks are {', '.join(TASKS)}")
    return TASKS[name]


def task_of(cfg: DictConfig) -> Task:
    """The task of the run `cfg` configures: the `task` of its data module's class (`cfg.data._target_`), read before
    anything is built.

    Example:
        >>> from omegaconf import OmegaConf
        >>> task_of(OmegaConf.create({"data": {"_target_": "attnreg.app.datamodules.AgreementDataModule"}}))
        ClassificationTask()
    """
    target = cfg.data._target_
    name = getattr(get_object(target), "task", None)
    if not isinstance(name, str):
        raise ValueError(
            f"data._target_ {target} names no task: give the class a `task` ({', '.join(TASKS)}), as the subclasses "
            "of attnreg.app.datamodules.AppDataModule have"
        )
    return task_named(name)


def task_of_summary(summary: Mapping[str, Any]) -> Task:
    """The task of a run's summary: its "task", classification where it has none (see `Task.named_in_summary`).

    Example:
        >>> task_of_summary({"task": "chat"}), task_of_summary({"accuracy": {"val": 0.5}})
        (ChatTask(), ClassificationTask())
    """
    return task_named(summary.get("task", CLASSIFICATION.name))


def is_causal_lm(model: PreTrainedModel) -> bool:
    """Whether `model` is a causal LM: a causal-LM class of a decoder family (`attnreg.app.models.decoder_family`).

    Example:
        >>> from attnreg.tiny import tiny_model
        >>> [is_causal_lm(tiny_model("llama", head=head)) for head in ("causal_lm", "classification")]
        [True, False]
    """
    return type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")) and decoder_family(model.config)


def _silenced(pruning: Mapping[str, Any]) -> str:
    """The silenced heads (grouped-query attention keeps them in place, adding nothing), for the pruning line."""
    silenced = "; ".join(f"layer {layer}: {heads}" for layer, heads in (pruning.get("silenced") or {}).items())
    return f"; silenced (in place, adding nothing): {silenced}" if silenced else ""


def _supervised(heads: Mapping[str, Any], pruning: Mapping[str, Any] | None) -> str:
    """The supervised heads' parent accuracy, a head that was removed or silenced named so."""
    silenced = {
        f"L{layer}H{head}" for layer, numbers in ((pruning or {}).get("silenced") or {}).items() for head in numbers
    }
    values = [
        f"{name} {'silenced' if value is None and name in silenced else _fraction(value)}"
        for name, value in heads["supervised"].items()
    ]
    return ", ".join(values) or "none"


def _fraction(value: float | None) -> str:
    return "removed" if value is None else f"{value:.3f}"
