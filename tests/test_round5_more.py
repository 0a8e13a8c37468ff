"""Issue 46, items 15, 17 and 20: a prior given as a Python list gets `check_prior`'s TypeError at every public entry;
`attnreg-analyze --gguf-file` opens a folder holding a GGUF file (SmolLM2 as `model=smollm2` loads it); a decoder
folder whose tokenizer cannot read the data is refused when the data is set up, before anything trains."""

import contextlib
import csv
import io
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import attnreg
from attnreg import blockwise, losses, methods
from attnreg.app.analyze import InputError, load_model, main
from attnreg.app.configs import CONFIG_DIR, register_resolvers
from attnreg.app.lm import TINY_CHAT_TEMPLATE, ChatDataModule, LMDataModule
from attnreg.app.task import build_tokenizer
from attnreg.app.train import train
from attnreg.losses import check_prior, prior_kl
from attnreg.methods.syntax_prior.method import SyntaxPriorKL
from attnreg.tiny import tiny_model

CLEAR = "prior must be a torch.Tensor"
LIST_PRIOR = [[1, -1, 1, 2]]
IDS = torch.tensor([[5, 6, 7, 8]])


# -- 15: a prior given as a list ----------------------------------------------------------------------------------
def test_functional_losses_refuse_a_list_prior_with_the_clear_type_error():
    probs = torch.softmax(torch.randn(1, 4, 4, 4), -1)
    with pytest.raises(TypeError, match=CLEAR):
        prior_kl(probs, LIST_PRIOR, heads=[3])
    with pytest.raises(TypeError, match=f"{CLEAR}.*got list"):
        check_prior(LIST_PRIOR, None)
    model = tiny_model("bert")
    with attnreg.attach(model).capture(layers=[0], inputs=True) as record:
        model(input_ids=IDS)
    with pytest.raises(TypeError, match=CLEAR):
        blockwise.prior_kl(record[0], LIST_PRIOR, heads=[2])
    assert (
        float(blockwise.prior_kl(record[0], torch.tensor(LIST_PRIOR), heads=[2]).detach()) > 0
    )  # the tensor still works


def test_check_prior_without_a_shape_checks_what_the_prior_says_of_itself():
    check_prior(torch.tensor([[1, -1]]), None)
    check_prior(torch.full((1, 2, 3), 1 / 3), None)
    with pytest.raises(ValueError, match=r"prior of shape \(4,\)"):
        check_prior(torch.tensor([1, 2, 3, 4]), None)
    with pytest.raises(TypeError, match="must be an integer tensor"):
        check_prior(torch.tensor([[1.0, 0.0]]), None)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
@pytest.mark.parametrize("use_blockwise", [True, False])
def test_the_method_through_the_runner_refuses_a_list_prior(family, use_blockwise):
    model = tiny_model(family)
    runner = methods.Runner([SyntaxPriorKL(heads={0: [3], 1: [2]}, blockwise=use_blockwise)])
    runner.bind(model)
    runner.start(10)
    batch = {"input_ids": IDS, "attnreg_prior": LIST_PRIOR}
    with pytest.raises(TypeError, match=rf"SyntaxPriorKL batch\['attnreg_prior'\]: {CLEAR}.*got list"):
        runner.window([batch])  # counts each term's rows ahead (the Hugging Face Trainer's path)
    with runner.capture(model, training=True) as captured:
        model(**runner.model_inputs(batch))
    with pytest.raises(TypeError, match=rf"SyntaxPriorKL batch\['attnreg_prior'\]: {CLEAR}.*got list"):
        runner.loss(captured, batch, step=1)
    batch["attnreg_prior"] = torch.tensor(LIST_PRIOR)  # the same rows as a tensor train
    with runner.capture(model, training=True) as captured:
        model(**runner.model_inputs(batch))
    assert float(runner.loss(captured, batch, step=1).detach()) > 0
    runner.teardown()


def test_items_refuses_a_list_prior_with_and_without_kinds():
    plain = SyntaxPriorKL(heads={0: [1]})
    plain.bind(tiny_model("gpt2"))
    with pytest.raises(TypeError, match=CLEAR):
        plain.items({"input_ids": IDS, "attnreg_prior": LIST_PRIOR})
    assert plain.items({"input_ids": IDS, "attnreg_prior": torch.tensor(LIST_PRIOR)}) == {"layer0": 2}
    kinds = SyntaxPriorKL(kinds={"parent": {0: [1]}, "nsubj": {1: [2]}})
    kinds.bind(tiny_model("gpt2"))
    batch = {"attnreg_prior.parent": torch.tensor(LIST_PRIOR), "attnreg_prior.dependents:nsubj": LIST_PRIOR}
    with pytest.raises(TypeError, match=rf"batch\['attnreg_prior.dependents:nsubj'\]: {CLEAR}"):
        kinds.items(batch)


# -- 17: attnreg-analyze --gguf-file --------------------------------------------------------------------------------
def bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=89, special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.train_from_iterator(["the dog sees the cat", "a cat sees a dog"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def write_conllu(path: Path, copies: int = 3) -> Path:
    words = [("the", 2, "det"), ("dog", 3, "nsubj"), ("sees", 0, "root"), ("the", 5, "det"), ("cat", 3, "obj")]
    rows = [f"{i}\t{word}\t_\t_\t_\t_\t{head}\t{rel}\t_\t_" for i, (word, head, rel) in enumerate(words, 1)]
    path.write_text(("# text = the dog sees the cat\n" + "\n".join(rows) + "\n\n") * copies)
    return path


def run_analyze(*argv: str) -> tuple[int | None, str]:
    out = io.StringIO()
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        try:
            code = main(list(argv))
        except SystemExit as stop:
            code = stop.code
    return code, out.getvalue()


@pytest.fixture(scope="module")
def gguf_folders(tmp_path_factory):
    pytest.importorskip("gguf")
    from attnreg.export import export_gguf

    root = tmp_path_factory.mktemp("gguf")
    tokenizer = bpe_tokenizer()
    model = tiny_model("llama", head="causal_lm", vocab=99, seed=3).eval()
    export_gguf(model, root / "gguf" / "tiny.f32.gguf", tokenizer)  # no config.json beside it
    model.model.save_pretrained(root / "saved")  # the same weights as a transformers folder
    tokenizer.save_pretrained(root / "saved")
    return root


def test_analyze_refuses_a_gguf_folder_without_gguf_file_naming_the_file_and_the_option(gguf_folders, tmp_path):
    data = write_conllu(tmp_path / "dev.conllu")
    code, said = run_analyze(str(gguf_folders / "gguf"), str(data), "--out", str(tmp_path / "r"))
    assert code == 2
    assert "no config.json but holds the GGUF file tiny.f32.gguf" in said and "--gguf-file" in said
    code, said = run_analyze(str(gguf_folders / "gguf"), str(data), "--out", str(tmp_path / "r"), "--gguf-file", "x")
    assert code == 2 and "--gguf-file x: no such file in" in said and "its GGUF files: tiny.f32.gguf" in said
    assert not (tmp_path / "r").exists()


def test_analyze_reads_the_gguf_file_as_the_same_model_with_its_tokenizer(gguf_folders, tmp_path):
    model, tokenizer = load_model(str(gguf_folders / "gguf"), gguf_file="tiny.f32.gguf")
    assert type(model).__name__ == "LlamaModel" and model.dtype == torch.float32 and not model.training
    assert not getattr(model, "is_quantized", False) and not hasattr(model, "hf_quantizer")
    assert not hasattr(model.config, "quantization_config")
    saved, saved_tokenizer = load_model(str(gguf_folders / "saved"))
    text = "the dog sees the cat"
    assert tokenizer(text)["input_ids"] == saved_tokenizer(text)["input_ids"]
    ids = torch.tensor([saved_tokenizer(text)["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(model(ids).last_hidden_state, saved(ids).last_hidden_state, atol=1e-4)

    data = write_conllu(tmp_path / "dev.conllu")
    reports = {}
    for name, extra in (("gguf", ["--gguf-file", "tiny.f32.gguf"]), ("saved", [])):
        out = tmp_path / name
        code, said = run_analyze(str(gguf_folders / name), str(data), "--out", str(out), "--no-plots", *extra)
        assert code == 0, said
        reports[name] = list(csv.DictReader((out / "statistics.csv").read_text().splitlines()))
    assert len(reports["gguf"]) == 8  # 2 layers x 4 heads
    for gguf_row, saved_row in zip(reports["gguf"], reports["saved"], strict=True):
        for key in ("parent_accuracy", "entropy"):
            assert float(gguf_row[key]) == pytest.approx(float(saved_row[key]), abs=1e-3), key


# -- 20: a decoder folder whose tokenizer cannot read the data ---------------------------------------------------
def decoder_folder(folder: Path, words: list[str]) -> Path:
    tokenizer = build_tokenizer(words)
    tiny_model("llama", head="causal_lm", vocab=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def composed(*overrides: str):
    register_resolvers()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("train", list(overrides))


def test_train_refuses_a_decoder_folder_whose_tokenizer_cannot_read_the_data_before_training(tmp_path):
    folder = decoder_folder(tmp_path / "model", ["alpha", "beta", "gamma"])
    data = write_conllu(tmp_path / "dev.conllu", copies=4)
    cfg = composed(
        "model=decoder",
        f"model.name_or_path={folder}",
        "data=text_lm",
        f"data.train={data}",
        f"data.val={data}",
        "trainer.max_steps=1",
        "trainer.enable_progress_bar=false",
        "~logger",
    )
    output_dir = tmp_path / "run"
    with pytest.raises(ValueError) as raised:
        train(cfg, output_dir)
    message = str(raised.value)
    assert message.startswith(f"data.train={data}: the tokenizer ({folder}) cannot tokenize the text: 100% of the 20")
    assert "Refused before training" in message
    assert not output_dir.exists()  # no checkpoint, no summary: nothing trained


def test_decoder_data_modules_check_the_tokenizer_at_setup(tmp_path):
    known = build_tokenizer(["the", "dog", "sees", "cat"])
    data = write_conllu(tmp_path / "dev.conllu")
    text = tmp_path / "val.txt"
    text.write_text("the dog sees a zebra quietly today\n")  # 4 of 7 words unknown
    LMDataModule(str(data), str(data), tokenizer=known).setup("fit")  # every word known: fine
    module = LMDataModule(str(data), str(text), tokenizer=known)
    with pytest.raises(ValueError, match=rf"data.val={text}: the tokenizer \(built from .*57% of the 7 words"):
        module.setup("fit")
    assert module.datasets == {}  # a second setup checks again
    chat = tmp_path / "chat.jsonl"
    row = {"messages": [{"role": "user", "content": "hola amigo"}, {"role": "assistant", "content": "buenos dias"}]}
    chat.write_text(json.dumps(row) + "\n")
    chat_tokenizer = build_tokenizer(["user", "assistant", "<", "|", ">"])
    with pytest.raises(ValueError, match=rf"data.train={chat}: the tokenizer .*100% of the 4 words"):
        ChatDataModule(str(chat), str(chat), tokenizer=chat_tokenizer, chat_template=TINY_CHAT_TEMPLATE).setup()


def test_load_model_names_the_missing_gguf_file(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(InputError, match="holds the GGUF files a.gguf, b.gguf: name the one to load with --gguf-file"):
        load_model(str(tmp_path))
    with pytest.raises(InputError, match="give a file name in the model directory"):
        load_model(str(tmp_path), gguf_file="sub/a.gguf")


@pytest.mark.parametrize(
    "call",
    [
        lambda prior: losses.prior_rows(prior),
        lambda prior: losses.causal_prior(prior),
        lambda prior: losses.reachable_prior(prior, None),
        lambda prior: blockwise.prior_cross_entropy(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), None, prior, 0.5),
    ],
    ids=["prior_rows", "causal_prior", "reachable_prior", "prior_cross_entropy"],
)
def test_every_public_function_taking_a_prior_refuses_a_list_by_name(call):
    with pytest.raises(TypeError, match="prior must be a torch.Tensor"):
        call([[0, 1, -1]])
