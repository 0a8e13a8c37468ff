"""Inputs refused before training (issue 46, items 5, 10 and 16): rows that would train on nothing (a chat row whose
assistant tokens `data.max_length` cuts away, a one-token text), a folder that is no decoder's or whose config.json
names no architectures, a tokenizer larger than the model's vocabulary; and the analysis leaving a model as it found
it. Real tiny models, real tokenizers; each refusal names the file:line, the setting and the sizes."""

import json
import re

import hydra
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from attnreg.analysis import analyze, head_statistics, parent_accuracy
from attnreg.app.configs import CONFIG_DIR, register_resolvers
from attnreg.app.lm import (
    TINY_CHAT_TEMPLATE,
    ChatCollator,
    ChatDataModule,
    HubChatDataModule,
    HubLMDataModule,
    LMCollator,
    LMDataModule,
    render_chat,
)
from attnreg.app.models import pretrained_causal_lm, pretrained_classifier, tiny_causal_lm
from attnreg.app.task import build_tokenizer, generate, vocabulary
from attnreg.hub import attach, is_attached
from attnreg.tiny import tiny_model

WORDS = ["hi", "there", "how", "are", "you", "fine", "thanks", "a", "long", "question", "about", "cats"]
LONG_USER = " ".join(["a", "long", "question", "about", "cats"] * 4)  # 20 words


def chat_tokenizer():
    tokenizer = build_tokenizer([*WORDS, "user", "assistant", "system", "<", "|", ">"])
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def chat_row(user, reply):
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def first_assistant_token(tokenizer, row):
    """Independently of the check: the number (1-based) of the first token of the rendered row that lies in the
    assistant's reply, found from the text before the reply (the conversation with the generation prompt)."""
    before = tokenizer.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    return len(tokenizer(before, add_special_tokens=False)["input_ids"]) + 1, len(
        tokenizer(whole, add_special_tokens=False)["input_ids"]
    )


# -- item 5: rows that would train on nothing -----------------------------------------------------------------------


def test_a_chat_row_whose_assistant_tokens_max_length_cuts_away_is_refused_at_setup(tmp_path):
    tokenizer = chat_tokenizer()
    short, cut = chat_row("hi", "fine thanks"), chat_row(LONG_USER, "fine thanks")
    train_file = write_rows(tmp_path / "train.jsonl", [short, cut, short])  # a mixed file: row 2 only is cut
    val_file = write_rows(tmp_path / "val.jsonl", [short])
    needed, whole = first_assistant_token(tokenizer, cut)
    assert needed > 16 >= first_assistant_token(tokenizer, short)[1]
    data = ChatDataModule(str(train_file), str(val_file), tokenizer=tokenizer, max_length=16)
    with pytest.raises(ValueError) as refused:
        data.setup("fit")
    message = str(refused.value)
    assert message.startswith(f"{train_file}:2: data.max_length=16 cuts away every assistant token")
    assert f"set data.max_length to {needed} or more" in message.lower()
    assert f"renders to {whole} tokens" in message and "train on nothing" in message
    assert data.datasets == {}


def test_the_app_refuses_a_chat_file_cut_by_max_length_before_training_not_a_nan_run(tmp_path):
    from attnreg.app.train import train

    path = write_rows(tmp_path / "chat.jsonl", [chat_row(LONG_USER, "fine thanks")] * 2)
    register_resolvers()
    overrides = ["data=chat", f"data.train={path}", f"data.val={path}", "data.max_length=8"]
    overrides += ["data.chat_template=" + json.dumps(TINY_CHAT_TEMPLATE), "trainer.max_steps=2"]
    with hydra.initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = hydra.compose("train", overrides)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:1: data\.max_length=8 cuts away every assistant"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_tokens_a_chat_row_needs_are_exactly_enough_and_its_loss_is_finite(tmp_path):
    """At the number the refusal gives, the row keeps one assistant token and its loss is finite; one less: refused
    (and a collator given such rows raises rather than hand out a batch with no label, whose loss is NaN)."""
    tokenizer = chat_tokenizer()
    cut = chat_row(LONG_USER, "fine thanks")
    needed, _ = first_assistant_token(tokenizer, cut)
    path = write_rows(tmp_path / "chat.jsonl", [cut, cut])
    with pytest.raises(ValueError, match=rf":1: data\.max_length={needed - 1} .* 1 more row is refused too"):
        ChatDataModule(str(path), str(path), tokenizer=tokenizer, max_length=needed - 1).setup("fit")
    data = ChatDataModule(str(path), str(path), tokenizer=tokenizer, max_length=needed, batch_size=2)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert (batch["labels"][:, 1:] != -100).sum(dim=1).tolist() == [1, 1]
    model = tiny_causal_lm(tokenizer)
    loss = model(**{key: batch[key] for key in ("input_ids", "attention_mask", "labels")}).loss
    assert torch.isfinite(loss)
    rows = [{**cut, "where": f"{path}:1"}]
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:1: no assistant token is left .*max_length=5"):
        ChatCollator(tokenizer, max_length=5)(rows)


def test_the_validation_file_and_hub_chat_rows_are_checked_too(tmp_path):
    tokenizer = chat_tokenizer()
    short, cut = chat_row("hi", "fine thanks"), chat_row(LONG_USER, "fine thanks")
    good = write_rows(tmp_path / "train.jsonl", [short])
    val = write_rows(tmp_path / "val.jsonl", [short, short, cut])
    data = ChatDataModule(str(good), str(val), tokenizer=tokenizer, max_length=16)
    for _ in range(2):  # a second setup checks again: the train split that passed was not kept alone
        with pytest.raises(ValueError, match=rf"^{re.escape(str(val))}:3: data\.max_length=16 cuts away"):
            data.setup("fit")
    files = {"train": str(val), "validation": str(good)}
    with pytest.raises(ValueError, match=r"^dataset json split train row 3: data\.max_length=16 cuts away"):
        HubChatDataModule("json", data_files=files, tokenizer=tokenizer, max_length=16).setup("fit")


def test_a_reply_that_renders_to_no_token_is_refused(tmp_path):
    tokenizer = chat_tokenizer()
    path = write_rows(tmp_path / "chat.jsonl", [chat_row("hi", "fine"), chat_row("hi", "")])
    text, spans = render_chat(tokenizer, chat_row("hi", "")["messages"])
    assert spans == [(len(text), len(text))]  # the tiny template writes nothing after an empty reply
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:2: the assistant's replies render to no token"):
        ChatDataModule(str(path), str(path), tokenizer=tokenizer, max_length=None).setup("fit")


def no_bos_tokenizer():
    """A real word-level tokenizer that, like GPT-2's, adds no BOS or EOS token."""
    vocab = {"[PAD]": 0, "[UNK]": 1, **{word: index for index, word in enumerate(WORDS, start=2)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]")


def test_a_one_token_text_row_is_refused_naming_its_line(tmp_path):
    tokenizer = no_bos_tokenizer()
    path = tmp_path / "train.txt"
    path.write_text("hi there\n\nhow are you\nfine\nthanks\n")
    assert len(tokenizer("fine")["input_ids"]) == 1  # alone in a batch, its loss would be NaN
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:4: 'fine' is 1 token .*\(1 more row is so\)"):
        LMDataModule(str(path), str(path), tokenizer=tokenizer).setup("fit")
    files = {"train": str(path), "validation": str(path)}
    with pytest.raises(ValueError, match=r"^dataset text split train row 4: 'fine' is 1 token"):
        HubLMDataModule("text", data_files=files, tokenizer=tokenizer).setup("fit")
    data = LMDataModule(str(path), str(path), tokenizer=tokenizer, min_words=2, min_words_val=2)  # the fix it names
    data.setup("fit")
    assert [row["text"] for row in data.datasets["train"]] == ["hi there", "how are you"]


def test_a_one_token_conllu_sentence_is_refused_naming_its_line(tmp_path):
    path = tmp_path / "train.conllu"
    path.write_text(
        "# sent_id = 1\n# text = hi there\n1\thi\thi\tINTJ\t_\t_\t0\troot\t_\t_\n2\tthere\tthere\tADV\t_\t_\t1\tadvmod"
        "\t_\t_\n\n# sent_id = 2\n# text = thanks\n1\tthanks\tthanks\tINTJ\t_\t_\t0\troot\t_\t_\n\n"
    )
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:6 \(sent_id 2\): 'thanks' is 1 token"):
        LMDataModule(str(path), str(path), tokenizer=no_bos_tokenizer()).setup("fit")


def test_a_max_length_that_leaves_no_token_to_predict_is_refused(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("hi there\n")
    with pytest.raises(ValueError, match=r"^data\.max_length=1 leaves each row at most 1 token"):
        LMDataModule(str(path), str(path), max_length=1).setup("fit")
    with pytest.raises(ValueError, match=r"^data\.max_length=1 "):
        LMCollator(build_tokenizer(["hi"]), max_length=1)


# -- item 10: a folder that is no decoder's, or names no architectures ---------------------------------------------


def save_without_architectures(model, folder, tokenizer=None):
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("architectures", None)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_decoder_folder_without_architectures_loads_as_the_causal_lm_it_is(tmp_path, family):
    tokenizer = build_tokenizer(vocabulary())
    saved = tiny_model(family, head="causal_lm", vocab=len(tokenizer)).eval()
    folder = save_without_architectures(saved, tmp_path / "model")
    model = pretrained_causal_lm(tokenizer, name_or_path=str(folder)).eval()
    assert type(model) is type(saved)
    ids = torch.tensor([[2, 7, 9, 11, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, saved(input_ids=ids).logits)  # its lm_head, not new


def test_a_decoder_folder_without_architectures_is_not_made_a_classifier_with_a_random_head(tmp_path):
    tokenizer = build_tokenizer(vocabulary())
    folder = save_without_architectures(tiny_model("llama", head="causal_lm", vocab=len(tokenizer)), tmp_path / "m")
    with pytest.raises(ValueError, match=r"no architectures in its config\.json and model_type 'llama' is a decoder"):
        pretrained_classifier(tokenizer, 2, str(folder))
    model = pretrained_classifier(tokenizer, 2, str(folder), new_head_on_causal_lm=True)  # the way out it names
    assert type(model).__name__ == "LlamaForSequenceClassification"
    encoder = save_without_architectures(tiny_model("bert", vocab=len(tokenizer)), tmp_path / "bert")
    assert type(pretrained_classifier(tokenizer, 2, str(encoder))).__name__ == "BertForSequenceClassification"


@pytest.mark.parametrize(
    ("family", "said"),
    [
        ("bert", "an encoder (bidirectional attention): as a causal LM (BertLMHeadModel) each token would attend"),
        ("distilbert", "an encoder (bidirectional attention), which transformers has no causal-LM class for"),
    ],
)
def test_an_encoder_folder_is_refused_as_a_causal_lm_naming_its_model_type(tmp_path, family, said):
    tokenizer = build_tokenizer(vocabulary())
    folder = save_without_architectures(tiny_model(family, vocab=len(tokenizer)), tmp_path / "model")
    with pytest.raises(ValueError, match=rf"^model\.name_or_path={re.escape(str(folder))} has model_type '{family}', "):
        pretrained_causal_lm(tokenizer, name_or_path=str(folder))
    with pytest.raises(ValueError, match=re.escape(said)):
        pretrained_causal_lm(tokenizer, name_or_path=str(folder))
    with pytest.raises(ValueError, match=rf"^model\.family={family} has model_type '{family}'"):
        tiny_causal_lm(tokenizer, family=family)


def test_the_app_refuses_an_encoder_folder_for_a_decoder_task_before_training(tmp_path):
    from attnreg.app.train import train

    tokenizer = build_tokenizer(vocabulary())
    folder = save_without_architectures(tiny_model("bert", vocab=len(tokenizer)), tmp_path / "model", tokenizer)
    register_resolvers()
    overrides = ["data=agreement_lm", "model=decoder", f"model.name_or_path={folder}", "data.train=8", "data.val=4"]
    with hydra.initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = hydra.compose("train", overrides)
    with pytest.raises(Exception, match=r"has model_type 'bert', an encoder") as refused:
        train(cfg, tmp_path / "run")
    assert "Traceback" not in str(refused.value) and not (tmp_path / "run" / "checkpoints").exists()


# -- item 16: a tokenizer larger than the model; the analysis leaves the model as it found it -----------------------


def test_a_tokenizer_larger_than_a_causal_lms_vocabulary_is_refused_naming_both_sizes(tmp_path):
    big = build_tokenizer([*vocabulary(), *(f"w{i}" for i in range(60))])
    tiny_model("llama", head="causal_lm", vocab=100).save_pretrained(tmp_path / "model")
    big.save_pretrained(tmp_path / "model")
    assert len(big) > 100
    with pytest.raises(ValueError) as refused:
        pretrained_causal_lm(big, name_or_path=str(tmp_path / "model"))
    message = str(refused.value)
    assert message.startswith(f"model.name_or_path={tmp_path / 'model'}: the tokenizer has {len(big)} tokens")
    assert "vocab_size 100" in message and "100 input embeddings" in message
    assert f"model.resize_token_embeddings({len(big)})" in message
    pretrained_causal_lm(build_tokenizer(["a"]), name_or_path=str(tmp_path / "model"))  # a tokenizer that fits


@pytest.fixture
def tokenizer():
    return build_tokenizer(vocabulary())


@pytest.fixture
def sentences():
    return [example.sentence for example in generate(4, seed=0)]


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_head_statistics_leaves_a_model_it_attached_detached_with_its_implementation(
    tokenizer, sentences, implementation
):
    model = tiny_model("llama", vocab=len(tokenizer))
    model.set_attn_implementation(implementation)
    for run in (head_statistics, parent_accuracy, analyze):
        run(model, tokenizer, sentences)
        assert not is_attached(model) and model.config._attn_implementation == implementation, run.__name__


def test_head_statistics_keeps_a_model_the_caller_attached_attached_with_its_gates(tokenizer, sentences):
    model = tiny_model("bert", vocab=len(tokenizer))
    hub = attach(model)
    with torch.no_grad():
        hub.gate(1)[2] = 0.5
    head_statistics(model, tokenizer, sentences)
    assert is_attached(model) and attach(model) is hub and model.config._attn_implementation == "attnreg"
    assert hub.gate(1).tolist() == [1.0, 1.0, 0.5, 1.0]


def test_head_statistics_detaches_the_model_when_it_raises(tokenizer, sentences):
    model = tiny_model("gpt2", vocab=len(tokenizer))
    with pytest.raises(TypeError, match="batch 0: expected a Sentence sequence or dicts with 'input_ids'"):
        head_statistics(model, tokenizer, [{"ids": torch.tensor([[5, 6]])}])  # fails inside the pass
    assert not is_attached(model) and model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="the tokenizer cannot tokenize the text"):
        head_statistics(model, build_tokenizer(["x"]), sentences)  # fails before it
    assert not is_attached(model) and model.config._attn_implementation == "sdpa"
    attach(model)
    with pytest.raises(TypeError):
        head_statistics(model, tokenizer, [{"ids": torch.tensor([[5, 6]])}])
    assert is_attached(model)  # the caller's attachment stays


def test_head_statistics_on_a_dora_model_detaches_without_folding_anything(tokenizer, sentences):
    """Nothing to fold (no gate, no temperature): detaching does not ask whether DoRA could take a fold."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[peft]')")
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "o_proj"], use_dora=True)
    model = peft.get_peft_model(tiny_model("llama", head="causal_lm", vocab=len(tokenizer)), config)
    inner = model.base_model.model
    statistics = head_statistics(inner, tokenizer, sentences)
    assert statistics["entropy"].shape == (2, 4)
    assert not is_attached(inner) and inner.config._attn_implementation == "sdpa"
