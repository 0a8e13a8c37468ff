"""The training app on decoders: causal LM and chat SFT with a tiny random Llama, LoRA, the syntax prior and head
gating, against independent references (each sentence scored alone, the rendered chat's assistant text, PEFT's own
reload of the adapter, an uninterrupted run, transformers' own Trainer and save/load), and the refusals of bad input
before training."""

import json
import math
import re
from pathlib import Path

import hydra
import pytest
import torch
from omegaconf import OmegaConf

from attnreg.app.collect import collect, paired_differences
from attnreg.app.configs import CONFIG_DIR, register_resolvers
from attnreg.app.lm import TINY_CHAT_TEMPLATE, AgreementLMDataModule, ChatCollator
from attnreg.app.models import clear_quantizer, pretrained_causal_lm, tiny_causal_lm
from attnreg.app.task import build_tokenizer
from attnreg.app.train import train
from attnreg.syntax.data import PRIOR_KEY
from attnreg.tiny import tiny_model

peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[peft]')")

SMALL = ["data.train=32", "data.val=8", "data.batch_size=8", "trainer.max_epochs=2", "generate_tokens=4"]
QUIET = ["trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1"]
CHAT_ROWS = [
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "where is the cat"},
            {"role": "assistant", "content": "the cat sees the dog"},
        ],
        "parse": {
            "words": ["the", "cat", "sees", "the", "dog"],
            "heads": [2, 3, 0, 5, 3],
            "relations": ["det", "nsubj", "root", "det", "obj"],
        },
    },
    {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "who runs"},
            {"role": "assistant", "content": "the dogs run"},
        ],
        "parse": {"words": ["the", "dogs", "run"], "heads": [2, 3, 0], "relations": ["det", "nsubj", "root"]},
    },
]


def compose(*overrides, small=True):
    register_resolvers()
    with hydra.initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return hydra.compose("train", [*(SMALL if small else []), *QUIET, *overrides])


def write_chat(folder, rows, name="chat.jsonl"):
    path = folder / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# -- data -----------------------------------------------------------------------------------------------------------


def test_lm_batches_are_padded_per_batch_and_the_loss_is_over_real_tokens_only():
    """Perplexity over padded batches of uneven rows equals the one from each sentence scored alone, unpadded."""
    data = AgreementLMDataModule(train=8, val=12, eval_batch_size=5, with_prior=True)
    data.setup()
    model = tiny_causal_lm(data.tokenizer).eval()
    widths = {batch["input_ids"].shape[1] for batch in data.loader("val")}
    assert len(widths) > 1  # each batch padded to its own longest row
    from attnreg.app.decoder_evaluation import perplexity

    total, tokens = 0.0, 0
    with torch.no_grad():
        for sentence in data.datasets["val"]:
            ids = data.tokenizer(sentence.text, return_tensors="pt")["input_ids"]
            logits = model(input_ids=ids).logits[0, :-1]
            total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
            tokens += ids.shape[1] - 1
    result = perplexity(model, data.loader("val"))
    assert result["tokens"] == tokens
    assert result["perplexity"] == pytest.approx(math.exp(total / tokens), rel=1e-4)


def test_chat_labels_are_the_assistant_tokens_and_the_prior_only_the_reply_words():
    tokenizer = build_tokenizer(
        "be brief where is the cat sees dog hi hello who runs run dogs < | > system user assistant".split()
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    from attnreg.syntax.priors import SyntaxPrior
    from attnreg.syntax.trees import Sentence

    rows = []
    for number, row in enumerate(CHAT_ROWS):
        parse, reply = row["parse"], row["messages"][-1]["content"]
        sentence = Sentence(f"row{number}", *(tuple(parse[k]) for k in ("words", "heads", "relations")), reply)
        rows.append({"messages": row["messages"], "where": f"row{number}", "sentence": sentence})
    batch = ChatCollator(tokenizer, SyntaxPrior("parent"))(rows)
    for index, row in enumerate(CHAT_ROWS):
        labels = batch["labels"][index]
        trained = tokenizer.decode(labels[labels >= 0])
        replies = [turn["content"] for turn in row["messages"] if turn["role"] == "assistant"]
        assert trained == " ".join(replies)  # every assistant turn, nothing else
        prior = batch[PRIOR_KEY][index]
        rows_with_prior = (prior >= 0).nonzero().flatten().tolist()
        reply_tokens = len(tokenizer.tokenize(replies[-1]))
        length = int(batch["attention_mask"][index].sum())
        assert all(length - reply_tokens <= position < length for position in rows_with_prior)
        parents = [row["parse"]["heads"][i] for i in range(reply_tokens) if row["parse"]["heads"][i] != 0]
        assert len(rows_with_prior) == len(parents)
        first = length - reply_tokens
        expected = {first + i: first + head - 1 for i, head in enumerate(row["parse"]["heads"]) if head}
        assert {p: int(prior[p]) for p in rows_with_prior} == expected


# -- runs ------------------------------------------------------------------------------------------------------------


def test_causal_lm_with_lora_prior_and_gating_saves_an_adapter_peft_reloads_to_the_merged_model(tmp_path):
    cfg = compose("data=agreement_lm", "attnreg=[syntax_prior_kl,head_gating]", "peft=lora", "peft.merge=true")
    summary = train(cfg, tmp_path)
    assert summary["task"] == "causal_lm" and summary["steps"] == 8
    assert 1 < summary["perplexity"]["val"] < 1000 and set(summary["continuations"]) == {"the dog", "the cats that see"}
    heads = summary["parent_accuracy"]
    assert set(heads["supervised"]) == {"L0H0", "L1H0"} and 0 < heads["left_parent_share"] < 1
    assert heads["best_offset"] < 0 and 0 <= heads["best_offset_accuracy"] <= 1
    assert summary["metrics"]["attnreg/syntax_prior_kl"] > 0 and "attnreg/head_gating" in str(summary["metrics"])
    # At the end of fit the gates are folded into the base weights and the adapter (`HeadGating`): the merged model
    # against an independent rebuild, the base model from its seed with the trained gates (the last checkpoint's)
    # multiplied into its output projections by hand, the adapter read back and merged by PEFT.
    merged = type(tiny_causal_lm(build_tokenizer(["a"]))).from_pretrained(summary["merged_model"]).eval()
    data = AgreementLMDataModule(train=32, val=8)
    data.setup()
    base = tiny_causal_lm(data.tokenizer)
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    with torch.no_grad():
        for layer in range(2):
            gate = state[f"model.base_model.model.model.layers.{layer}.self_attn.attnreg_gate"]
            assert not torch.equal(gate, torch.ones(4))  # trained under the L1 penalty
            base.model.layers[layer].self_attn.o_proj.weight.mul_(gate.repeat_interleave(16)[None, :])
    reloaded = peft.PeftModel.from_pretrained(base, summary["adapter"]).merge_and_unload().eval()
    batch = next(iter(data.loader("val")))
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).logits, reloaded(**inputs).logits, rtol=1e-5, atol=1e-5)


def test_chat_sft_with_lora_and_the_prior_runs_and_reports(tmp_path):
    path = write_chat(tmp_path, CHAT_ROWS * 8)
    cfg = compose(
        "data=chat",
        f"data.train={path}",
        f"data.val={path}",
        "data.chat_template=" + json.dumps(TINY_CHAT_TEMPLATE),
        "peft=lora",
        "attnreg=syntax_prior_kl",
        "data.prompts=[the cat]",
    )
    summary = train(cfg, tmp_path / "run")
    assert summary["task"] == "chat" and summary["steps"] == 4
    assert summary["prior_arcs"]["causal_rows"] > 0 and summary["parent_accuracy"]["sentences"] == 16
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()


def test_head_removal_on_a_decoder_reports_size_and_generation_speed_against_the_unpruned_model(tmp_path):
    cfg = compose(  # GPT-2: every head removable alone (a Llama loses a key/value group only whole)
        "data=agreement_lm",
        "model.family=gpt2",
        "attnreg=head_gating",
        "attnreg.head_gating.removal.keep=4",
        "attnreg.head_gating.removal.after_steps=4",
    )
    summary = train(cfg, tmp_path)
    pruning = summary["pruning"]
    assert sum(len(heads) for heads in pruning["removed"].values()) == 4
    speed = pruning["generation"]
    assert speed["pruned"]["parameters"] == pruning["parameters"] < speed["unpruned"]["parameters"]
    assert pruning["speedup"] > 0 and (tmp_path / "pruned_model").is_dir()


def test_a_run_interrupted_mid_way_resumes_from_its_last_checkpoint_to_the_same_weights(tmp_path):
    import lightning as L

    class Interrupt(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 6:  # mid-way through the second of three epochs
                raise RuntimeError("interrupted")

    overrides = ["data=agreement_lm", "attnreg=[syntax_prior_kl,head_gating]", "trainer.max_epochs=3"]
    whole = train(compose(*overrides), tmp_path / "whole")
    cfg = compose(*overrides, "+trainer.callbacks=[]")
    OmegaConf.set_struct(cfg, False)
    from unittest import mock

    real = hydra.utils.instantiate

    def with_interrupt(node, *args, **kwargs):
        if "callbacks" in kwargs and node is cfg.trainer:
            kwargs["callbacks"] = [*kwargs["callbacks"], Interrupt()]
        return real(node, *args, **kwargs)

    with mock.patch("attnreg.app.train.instantiate", side_effect=with_interrupt), pytest.raises(RuntimeError):
        train(cfg, tmp_path / "cut")
    last = tmp_path / "cut" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 4
    resumed = train(compose(*overrides, f"+ckpt_path={last}"), tmp_path / "cut")
    assert resumed["steps"] == whole["steps"] == 12
    final = {
        name: torch.load(run["checkpoint"].replace("best", "last"), weights_only=False)["state_dict"]
        for name, run in (("whole", whole), ("resumed", resumed))
    }
    assert final["whole"].keys() == final["resumed"].keys()
    for key, value in final["whole"].items():
        torch.testing.assert_close(final["resumed"][key], value, rtol=0, atol=1e-6, msg=key)


# -- refusals before training ------------------------------------------------------------------------------------------


def test_bad_decoder_input_is_refused_before_training_naming_the_file_row_or_module(tmp_path):
    bad = [{"messages": [{"role": "user", "content": "hi"}]}]
    path = write_chat(tmp_path, CHAT_ROWS + bad)
    template = "data.chat_template=" + json.dumps(TINY_CHAT_TEMPLATE)
    cases = {
        f"{path}:3: no assistant turn": ["data=chat", f"data.train={path}", f"data.val={path}", template],
        "has none: use an instruct model's tokenizer": ["data=chat", f"data.train={path}", f"data.val={path}"],
        "peft.target_modules: no module of LlamaForCausalLM is named 'query'": [
            "data=agreement_lm",
            "peft=lora",
            "peft.target_modules=[query]",
        ],
        "layers=7 is out of range: LlamaForCausalLM has 2 attention layers": [
            "data=agreement_lm",
            "attnreg.syntax_prior_kl.layers=[7]",
        ],
    }
    empty = tmp_path / "empty.conllu"
    empty.write_text("")
    cases[str(empty)] = ["data=text_lm", f"data.train={empty}", f"data.val={empty}"]
    mismatch = tmp_path / "mismatch.conllu"
    mismatch.write_text(
        "# sent_id = s1\n# text = Keys rattle.\n1\tKeys\t_\t_\t_\t_\t2\tnsubj\t_\t_\n"
        "2\trustle\t_\t_\t_\t_\t0\troot\t_\t_\n\n"
    )
    cases[f"{mismatch}:1 (sent_id s1):"] = [
        "data=text_lm",
        f"data.train={mismatch}",
        f"data.val={mismatch}",
    ]
    for message, overrides in cases.items():
        run = tmp_path / f"run{len(message)}"
        with pytest.raises((ValueError, IndexError)) as caught:
            train(compose(*overrides), run)
        assert message in str(caught.value), (message, str(caught.value))
        assert not (run / "checkpoints").exists()  # before any training step


def test_a_causal_lm_is_refused_by_name_on_the_classifier_path(tmp_path):
    folder = tmp_path / "llama"
    tiny_model("llama", head="causal_lm", vocab=64).save_pretrained(folder)
    build_tokenizer(["a"]).save_pretrained(folder)
    for overrides, message in [
        (["model=hub", f"model.name_or_path={folder}"], "is a causal LM (LlamaForCausalLM)"),
        (["model=decoder", f"model.name_or_path={folder}"], "model LlamaForCausalLM is a causal LM and the data is"),
        (["data=agreement_lm", "model=tiny_bert"], "is not a causal LM"),
    ]:
        with pytest.raises(Exception, match=re.escape(message)):  # Hydra wraps what a factory raises, message included
            train(compose(*overrides), tmp_path / "run")


# -- GGUF flags, collect ---------------------------------------------------------------------------------------------


def test_a_model_with_a_dequantized_ggufs_quantizer_flags_is_refused_by_the_trainer_until_cleared(tmp_path):
    from transformers import GgufConfig, Trainer, TrainingArguments
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer

    folder = tmp_path / "llama"
    tiny_model("llama", head="causal_lm").save_pretrained(folder)
    model = pretrained_causal_lm(None, name_or_path=str(folder))
    quantizer = GgufHfQuantizer(GgufConfig(dequantize=True))  # what from_pretrained(gguf_file=...) leaves on 5.24
    model.hf_quantizer, model.is_quantized = quantizer, True
    model.config.quantization_config = quantizer.quantization_config
    arguments = TrainingArguments(str(tmp_path / "out"), report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="quantiz"):
        Trainer(model=model, args=arguments)
    clear_quantizer(model)
    Trainer(model=model, args=arguments)  # accepted now
    model.save_pretrained(tmp_path / "saved")
    again = type(model).from_pretrained(tmp_path / "saved").eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, model.eval()(input_ids=ids).logits)
    assert "quantization_config" not in (tmp_path / "saved" / "config.json").read_text()


def test_collect_pairs_seeds_against_a_baseline_on_the_decoder_columns():
    rows = [("0", "0", 20.0, 0.2), ("0", "1", 22.0, 0.3), ("0.3", "0", 21.0, 0.5), ("0.3", "1", 22.5, 0.7)]
    runs = [
        {
            "overrides": {"w": w, "seed": s},
            "summary": {"perplexity": {"val": p}, "parent_accuracy": {"supervised_mean": a}},
        }
        for w, s, p, a in rows
    ]
    table = collect(runs, metrics=["perplexity.val", "parent_accuracy.supervised_mean"])
    assert table["metrics"] == ["perplexity.val", "parent_accuracy.supervised_mean"]
    differences = paired_differences(runs, table, baseline={"w": "0"})
    (row,) = differences["groups"]
    assert row["overrides"] == {"w": "0.3"} and row["pairs"] == 2
    assert row["parent_accuracy.supervised_mean"]["values"] == pytest.approx([0.3, 0.4])
    assert row["perplexity.val"]["values"] == pytest.approx([1.0, 0.5])


@pytest.mark.slow
def test_mlflow_logs_offline_to_a_local_store(tmp_path):
    pytest.importorskip("mlflow")
    summary = train(compose("data=agreement_lm", "attnreg=none", "logger=mlflow"), tmp_path)
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("attnreg").experiment_id])
    assert run.data.metrics["val/perplexity"] == pytest.approx(summary["metrics"]["val/perplexity"], rel=1e-3)


# -- every decoder option of the model and data groups -------------------------------------------------------------


@pytest.mark.parametrize("option", ["tiny_llama_lm", "decoder"])
def test_every_decoder_model_option_builds_a_causal_lm(option, tmp_path):
    folder = tmp_path / "llama"
    tiny_model("llama", head="causal_lm", vocab=64).save_pretrained(folder)
    extra = [f"model.name_or_path={folder}"] if option == "decoder" else []
    cfg = compose("data=agreement_lm", f"model={option}", *extra)
    data = hydra.utils.instantiate(cfg.data, tokenizer=None, with_prior=False)
    model = hydra.utils.instantiate(cfg.model, tokenizer=data.tokenizer, num_labels=None)
    assert type(model).__name__ == "LlamaForCausalLM" and cfg.module._target_.endswith("CausalLM")
    assert model(input_ids=torch.tensor([[2, 5, 6]])).logits.shape[:2] == (1, 3)


@pytest.mark.parametrize("option", ["agreement_lm", "ewt_lm", "text_lm", "hf_lm", "chat", "hf_chat"])
def test_every_decoder_data_option_gives_lm_batches(option, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("the dog sees a cat\nthe cats run home\n")
    chat = write_chat(tmp_path, [{"messages": row["messages"]} for row in CHAT_ROWS], "rows.jsonl")
    files = {
        "text_lm": [f"data.train={text}", f"data.val={text}"],
        "hf_lm": ["data.path=text", f"data.data_files={{train: '{text}', validation: '{text}'}}"],
        "chat": [f"data.train={write_chat(tmp_path, CHAT_ROWS)}", f"data.val={write_chat(tmp_path, CHAT_ROWS)}"],
        "hf_chat": ["data.path=json", f"data.data_files={{train: '{chat}', validation: '{chat}'}}"],
    }
    template = ["data.chat_template=" + json.dumps(TINY_CHAT_TEMPLATE)] if "chat" in option else []
    limit = ["data.limit_train=64"] if option == "ewt_lm" else []
    cfg = compose(f"data={option}", *files.get(option, []), *template, *limit, small=False)
    if option == "ewt_lm" and not Path(cfg.data.train).is_file():
        pytest.skip(f"UD English EWT is not at {cfg.data.train}")
    data = hydra.utils.instantiate(cfg.data, tokenizer=None, with_prior=False)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert data.task in ("causal_lm", "chat") and set(batch) == {"input_ids", "attention_mask", "labels"}
    assert ((batch["labels"] == -100) | (batch["labels"] == batch["input_ids"])).all()


def test_lora_on_a_classification_task_trains_the_new_head_too(tmp_path):
    """PEFT leaves a new classification head frozen at its random initialisation unless told the task: the app's
    adapter for a classifier holds the trained head."""
    from safetensors.torch import load_file

    cfg = compose("model=tiny_llama", "peft=lora", "attnreg=none", "data.test=8", "data.hard=8")
    summary = train(cfg, tmp_path)
    saved = load_file(f"{summary['adapter']}/adapter_model.safetensors")
    head = [name for name in saved if "score" in name]
    assert head, sorted(saved)
    initial = tiny_model("llama", head="classification", vocab=58, hidden=64, heads=4, pad_token_id=0).score.weight
    assert not torch.allclose(saved[head[0]], initial)
