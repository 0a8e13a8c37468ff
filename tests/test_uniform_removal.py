"""The uniform removal policy: the same number of key/value groups (heads) kept in every layer, each layer's
least important going, so that the pruned model has one head count for all layers and exports as a plain
transformers checkpoint. The reference is a per-layer ranking written here, independent of `select_heads`."""

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM

from attnreg.export import ExportError, export_transformers
from attnreg.methods import ImportanceRemoval, Loop
from attnreg.methods.pruning import head_importance, prune_heads, pruned_heads, select_groups, select_heads
from attnreg.tiny import tiny_model

IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])


def per_layer_reference(scores, keep_each):
    """Each layer keeps its `keep_each` highest scores (ties: the lower head number stays)."""
    removed = {}
    for layer, score in scores.items():
        ranked = sorted(range(score.numel()), key=lambda head: (-float(score[head]), head))
        removed[layer] = sorted(ranked[keep_each:])
    return removed


@pytest.mark.parametrize("seed", range(5))
def test_select_heads_uniform_matches_a_per_layer_ranking(seed):
    generator = torch.Generator().manual_seed(seed)
    scores = {layer: torch.rand(6, generator=generator) * (10 if layer == 1 else 1) for layer in range(3)}
    for keep_each in range(7):
        expected = per_layer_reference(scores, keep_each)
        assert select_heads(scores, keep=3 * keep_each, uniform=True) == expected
    free = select_heads(scores, keep=6)  # the free choice takes layer 1's heads first, the uniform one cannot
    assert {len(heads) for heads in free.values()} != {4}
    assert {len(heads) for heads in select_heads(scores, keep=6, uniform=True).values()} == {4}


def test_select_groups_uniform_is_the_per_layer_ranking_of_group_means():
    scores = {0: torch.tensor([0.9, 0.7, 0.6, 0.5, 0.4, 0.3]), 1: torch.tensor([0.3, 0.1, 0.2, 0.4, 0.0, 0.9])}
    means = {layer: score.view(3, 2).mean(dim=1) for layer, score in scores.items()}
    groups = per_layer_reference(means, 1)
    expected = {layer: [2 * g + i for g in removed for i in range(2)] for layer, removed in groups.items()}
    assert select_groups(scores, {0: 2, 1: 2}, keep=2, uniform=True) == expected


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda s: select_heads(s, keep=3, uniform=True), "keep=3 is not the same number in each of the 2 layers"),
        (lambda s: select_heads(s, keep=10, uniform=True), "keep=10 is not the same number"),
        (lambda s: select_heads(s, threshold=0.5, uniform=True), "uniform=True needs keep="),
    ],
)
def test_uniform_refusals(call, message):
    scores = {0: torch.rand(4), 1: torch.rand(6)}
    with pytest.raises(ValueError, match=message):
        call(scores)


def test_importance_removal_uniform_equals_pruning_by_the_per_layer_ranking_and_exports_plain(tmp_path):
    """The method on a 4-layer grouped-query Llama (4 query heads, 2 groups a layer): one group a layer goes, the
    one of lower mean importance; the result equals `prune_heads` of that reference choice and loads as a plain
    checkpoint, while a free choice (5 of 8 groups kept) leaves uneven layers that the plain export refuses."""
    batches = [{"input_ids": IDS, "labels": IDS}]
    model = tiny_model("llama", head="causal_lm", layers=4, seed=3).eval()
    reference = tiny_model("llama", head="causal_lm", layers=4, seed=3).eval()
    scores = head_importance(tiny_model("llama", head="causal_lm", layers=4, seed=3), batches)
    means = {layer: score.view(2, 2).mean(dim=1) for layer, score in scores.items()}
    groups = per_layer_reference(means, 1)
    prune_heads(reference, {layer: [2 * g + i for g in removed for i in range(2)] for layer, removed in groups.items()})

    removal = ImportanceRemoval(batches, keep=4, uniform=True)
    removal.bind(model)
    removal.start(10)
    removal.on_fit_start(Loop())
    assert pruned_heads(model) == pruned_heads(reference)
    with torch.no_grad():
        assert torch.allclose(model(IDS).logits, reference(IDS).logits, atol=1e-6)
    plain = AutoModelForCausalLM.from_pretrained(export_transformers(model, tmp_path / "plain")).eval()
    with torch.no_grad():
        assert torch.allclose(plain(IDS).logits, model(IDS).logits, atol=1e-5)

    free = tiny_model("llama", head="causal_lm", layers=4, seed=3).eval()
    choice = select_groups(scores, {layer: 2 for layer in range(4)}, keep=5)  # 3 of 8 groups: never even
    prune_heads(free, {layer: heads for layer, heads in choice.items() if heads})
    with pytest.raises(ExportError, match="differ"):
        export_transformers(free, tmp_path / "free")
    assert not (tmp_path / "free").exists()


def test_importance_removal_uniform_refuses_a_count_that_cannot_be_even():
    model = tiny_model("llama", head="causal_lm", layers=3)
    with pytest.raises(ValueError, match=r"uniform=True .* 4 kept is not a multiple of the 3 layers.*keep=3"):
        ImportanceRemoval([{"input_ids": IDS, "labels": IDS}], keep=4, uniform=True).bind(model)


def test_every_even_keep_is_reachable():
    scores = {layer: torch.rand(4) for layer in range(2)}
    for keep in range(0, 9, 2):
        removed = select_heads(scores, keep=keep, uniform=True)
        assert [4 - len(heads) for heads in removed.values()] == [keep // 2] * 2
    assert list(itertools.chain(*select_heads(scores, keep=0, uniform=True).values())) == [0, 1, 2, 3] * 2
