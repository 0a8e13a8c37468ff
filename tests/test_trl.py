"""attnreg's methods in TRL's `SFTTrainer` with a LoRA `peft_config` and TRL's defaults (gradient checkpointing
on): every term is logged and changes the adapter's weights against the same run without them; the syntax prior
covers the words of a chat-formatted text and no template token; heads removed at the end leave a model that
saves, reloads and generates like the gated one."""

import tempfile

import pytest
import torch

from attnreg import methods
from attnreg.app.task import build_tokenizer, generate, vocabulary
from attnreg.hub import hub_of
from attnreg.integrations.hf import with_attnreg
from attnreg.methods.pruning import load_pruned, save_pruned
from attnreg.syntax import PRIOR_KEY, SyntaxCollator
from attnreg.tiny import tiny_model

trl = pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[trl]')")
peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[peft]')")
datasets = pytest.importorskip("datasets", reason="datasets is not installed")

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|>\n{% endfor %}"


def tokenizer():
    tokens = build_tokenizer([*vocabulary(), "<|user|>", "<|assistant|>", "<|end|>"])
    tokens.chat_template = TEMPLATE
    return tokens


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "repeat"}, {"role": "assistant", "content": text}]


def rows(count: int) -> list[dict]:
    """A parsed corpus as a `datasets.Dataset` holds it: each sentence's fields."""
    return [
        {"words": list(s.words), "heads": list(s.heads), "relations": list(s.relations), "text": s.text}
        for s in (example.sentence for example in generate(count, seed=1))
    ]


def test_the_prior_covers_the_words_of_a_chat_and_no_template_token():
    tokens = tokenizer()
    collate = SyntaxCollator(tokens, messages=chat, lm_labels=True, causal=True)
    examples = rows(2)
    batch = collate(examples)
    for row, example in enumerate(examples):
        rendered = tokens.apply_chat_template(chat(example["text"]), tokenize=False)
        start = rendered.rfind(example["text"])
        offsets = tokens(rendered, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        inside = torch.tensor([start <= begin and end <= start + len(example["text"]) for begin, end in offsets])
        prior = batch[PRIOR_KEY][row][: len(offsets)]
        assert (prior[~inside] == -1).all()  # no template token is a row of the prior...
        assert inside[prior[prior >= 0]].all()  # ...nor a parent
        assert int((prior >= 0).sum()) == len(example["words"]) - 1  # a row for every word but the root
    assert collate.stats.arcs_dropped == 0 and collate.stats.causal_rows_dropped > 0  # right parents: said, counted
    padded, labels = batch["attention_mask"] == 0, batch["labels"]
    assert (labels[padded] == -100).all() and torch.equal(labels[~padded], batch["input_ids"][~padded])


def sft(tmp_path, chosen, steps=4, train=True, **options):
    tokens = tokenizer()
    torch.manual_seed(0)
    trainer_class = with_attnreg(trl.SFTTrainer)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"])
    args = trl.SFTConfig(
        str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        dataset_kwargs={"skip_prepare_dataset": True},
        **options,
    )
    trainer = trainer_class(
        model=tiny_model("llama", head="causal_lm", vocab=len(tokens)).train(),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows(4 * steps)),
        data_collator=SyntaxCollator(tokens, messages=chat, lm_labels=True, causal=True),
        processing_class=tokens,
        peft_config=config,
        methods=chosen,
    )
    assert trainer.args.gradient_checkpointing  # TRL's default
    if train:
        trainer.train()
    return trainer


def lora_weights(trainer) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in trainer.model.named_parameters() if "lora_" in name}


def test_sft_trainer_with_lora_runs_every_method(tmp_path):
    chosen = [
        methods.EntropyRegularizer(weight=1.0, mode="max"),
        methods.SyntaxPriorKL(heads={1: [0]}, weight=1.0),
        methods.AttentionDropoutSchedule(0.1),
        methods.HeadGating(methods.L1Gates(weight=0.05), methods.Removal(keep=6)),
    ]
    trainer = sft(tmp_path / "with", chosen)
    plain = sft(tmp_path / "without", [])
    logged = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logged) == 4
    for name in (
        "attnreg/entropy_regularizer",
        "attnreg/syntax_prior_kl",
        "attnreg/attention_dropout_schedule",
        "attnreg/head_gating",
    ):
        assert all(name in log for log in logged), name
    moved = lora_weights(trainer)
    same = lora_weights(plain)
    assert moved.keys() == same.keys() and any(not torch.equal(moved[k], same[k]) for k in moved)

    gating = chosen[3]
    assert gating.pruned and sum(map(len, gating.removed.values())) == 2
    merged = trainer.model.merge_and_unload().eval()
    assert not hub_of(merged).gates  # folded at the removal
    folder = save_pruned(merged, tempfile.mkdtemp())
    loaded = load_pruned(folder)
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(prompt).logits, merged(prompt).logits, rtol=0, atol=1e-6)
        expected = merged.generate(prompt, max_new_tokens=5, do_sample=False)
        assert torch.equal(loaded.generate(prompt, max_new_tokens=5, do_sample=False), expected)


def test_reentrant_checkpointing_is_refused_with_terms(tmp_path):
    reentrant = {"use_reentrant": True}
    with pytest.raises(ValueError, match=r"use_reentrant.*the terms of \['entropy_regularizer'\] would do nothing"):
        sft(tmp_path, [methods.EntropyRegularizer()], train=False, gradient_checkpointing_kwargs=reentrant)
    sft(
        tmp_path, [methods.AttentionDropoutSchedule(0.1)], train=False, gradient_checkpointing_kwargs=reentrant
    )  # no term
