"""The head view of an `attnreg-train` run that trained a LoRA adapter (`peft=lora`): the adapter is loaded onto the
base model and merged, and what the view shows equals the eager attention and the statistics of the merged model the
run saved itself (`merged_model/`), not the base model's."""

import base64
import sys
from unittest import mock

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import attnreg
from attnreg.analysis import head_statistics
from attnreg.app.train import main as train_main
from attnreg.app.view import main as view_main
from attnreg.app.view import view_run

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny random Llama trained as a causal LM through LoRA, the prior on head 0; one epoch, so its best
    checkpoint (the view's) holds the final weights (the run's merged_model/)."""
    run_dir = tmp_path_factory.mktemp("lora_run")
    run = ["data=agreement_lm", "peft=lora", "peft.merge=true", "data.train=64", "data.val=16", "module.lr=0.05"]
    quiet = ["trainer.max_epochs=1", "trainer.enable_progress_bar=false", "hydra/job_logging=none"]
    hydra = ["hydra/hydra_logging=none", f"hydra.run.dir={run_dir}"]
    with mock.patch.object(sys, "argv", ["attnreg-train", *run, *quiet, *hydra]):
        train_main()
    return run_dir


def decode(arcs, name, dtype, shape):
    return np.frombuffer(base64.b64decode(arcs[name]), dtype=dtype).reshape(shape)


def test_view_shows_the_merged_adapter(lora_run, capsys):
    view, heads = view_run(lora_run, sentences=4)
    assert heads == "L0H0, L1H0" and [model["name"] for model in view.models] == ["trained", "at the start"]
    merged = AutoModelForCausalLM.from_pretrained(lora_run / "merged_model").eval()
    tokenizer = AutoTokenizer.from_pretrained(lora_run / "merged_model")
    sentences = [document["words"] for document in view.documents]
    texts = [" ".join(words) for words in sentences]

    # the statistics (float, not quantized): the merged model's, and not the base model's
    batches = [dict(tokenizer(text, return_tensors="pt")) for text in texts]
    reference = head_statistics(merged, tokenizer, batches, max_length=512)
    shown, start = view.models[0]["statistics"], view.models[1]["statistics"]
    for name in reference:
        torch.testing.assert_close(torch.tensor(shown[name]), reference[name], rtol=1e-5, atol=1e-6)
    assert (torch.tensor(shown["entropy"]) - torch.tensor(start["entropy"])).abs().max() > 1e-3  # LoRA changed it

    # the arcs: each query's top keys and their weights (one byte) are the merged model's eager attention's
    hub = attnreg.attach(merged)
    for text, document in zip(texts, view.documents, strict=True):
        encoding = tokenizer(text, return_tensors="pt")
        tokens = len(document["tokens"])
        assert encoding["input_ids"].shape[1] == tokens
        with torch.no_grad(), hub.capture() as probs:
            merged(**encoding)
        shape = (view.layers, view.heads, tokens, view.top_k)
        keys = decode(document["models"][0], "keys", "<u2", shape).astype(np.int64)
        weights = decode(document["models"][0], "weights", np.uint8, shape) / 255
        for layer in range(view.layers):
            attention = probs[layer][0].float()
            top = attention.topk(view.top_k, dim=-1).values.numpy()
            np.testing.assert_allclose(weights[layer], top, atol=0.5 / 255 + 1e-6)
            chosen = attention.gather(-1, torch.from_numpy(keys[layer]))
            chosen = torch.where(torch.from_numpy(weights[layer]) > 0, chosen, 0.0)  # a causal row's empty slots
            np.testing.assert_allclose(chosen.numpy(), weights[layer], atol=0.5 / 255 + 1e-6)

    assert view_main([str(lora_run), "--sentences", "2"]) == 0  # the command writes the page
    assert f"(2 sentences): {lora_run / 'head_view.html'}" in capsys.readouterr().out
