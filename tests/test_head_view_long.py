"""The head view of a 2,048-token document in headless Chromium, as a person sees it: the parse overlay (gold arcs
and each head's predicted parents) is drawn at the start of the document and after scrolling to its far end, where
a canvas as wide as the document (about 80,000 px, beyond what a browser draws) once stayed blank. Skipped with the
reason where Chromium or playwright is absent (CI installs Chromium in `.ci/run`)."""

import importlib.util
import io
import shutil

import numpy as np
import pytest

from attnreg.analysis import head_view
from attnreg.app.task import build_tokenizer, generate, vocabulary
from attnreg.syntax import Sentence
from attnreg.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--no-sandbox",
    "--no-first-run",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # every host name fails to resolve
]
TOKENS = 2048
FRAMES = "new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))"


def long_sentence(words: int) -> Sentence:
    """One tree of exactly `words` words (one token each): generated sentences one after another, each root under
    the first, then full stops under the first root up to the count.

    Example:
        >>> len(long_sentence(100).words)
        100
    """
    parts, count, seed = [], 0, 0
    while words - count > 2 and seed < 20:
        for example in generate(50, seed=seed):
            if count + len(example.sentence.words) <= words:
                parts.append(example.sentence)
                count += len(example.sentence.words)
        seed += 1
    heads, start, root = [], 0, parts[0].heads.index(0) + 1
    for part in parts:
        heads += [start + head if head else (0 if not start else root) for head in part.heads]
        start += len(part.words)
    stops = words - start
    return Sentence(
        "long",
        tuple(word for part in parts for word in part.words) + (".",) * stops,
        tuple(heads) + (root,) * stops,
        tuple(relation for part in parts for relation in part.relations) + ("punct",) * stops,
        " ".join([part.text for part in parts] + ["."] * stops),
    )


def overlay_pixels(page) -> tuple[int, int]:
    """(pixels not white, coloured pixels: the predicted parents' green and blue) of the parse canvas, as far as
    its box shows it, from a screenshot of the page."""
    from PIL import Image

    outer = page.locator("#parsebox").bounding_box()
    canvas = page.locator("#parse").bounding_box()
    left, top = max(outer["x"], canvas["x"]), max(outer["y"], canvas["y"])
    right = min(outer["x"] + outer["width"], canvas["x"] + canvas["width"])
    bottom = min(outer["y"] + outer["height"], canvas["y"] + canvas["height"])
    assert right - left > 100 and bottom - top > 100, (outer, canvas)
    clip = {"x": left, "y": top, "width": right - left, "height": bottom - top}
    pixels = np.asarray(Image.open(io.BytesIO(page.screenshot(clip=clip))).convert("RGB")).astype(int)
    drawn = int((pixels.min(-1) < 235).sum())
    coloured = int((pixels.max(-1) - pixels.min(-1) > 60).sum())
    return drawn, coloured


def test_parse_overlay_is_drawn_on_a_2048_token_document(tmp_path):
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (apt-get install -y chromium; .ci/run installs it for CI)")
    if importlib.util.find_spec("playwright") is None:
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    from playwright.sync_api import sync_playwright

    tokenizer = build_tokenizer(vocabulary())
    model = tiny_model("bert", vocab=len(tokenizer), positions=TOKENS).eval()
    sentence = long_sentence(TOKENS - 2)  # and [CLS], [SEP]
    view = head_view(model, tokenizer, [sentence], max_length=TOKENS)
    assert len(view.documents[0]["tokens"]) == TOKENS
    words = len(sentence.words)
    path = view.save(tmp_path / "long.html")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = chromium.new_page(viewport={"width": 1400, "height": 950})
            errors = []
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(path.as_uri())
            page.wait_for_selector("body[data-ready='1']", timeout=60_000)
            page.locator("#parsebox").scroll_into_view_if_needed()
            start = overlay_pixels(page)
            width = page.evaluate("document.getElementById('parsebox').scrollWidth")
            assert width > 40_000  # the document is that wide: the overlay scrolls over it
            page.evaluate("(box => { box.scrollLeft = box.scrollWidth; })(document.getElementById('parsebox'))")
            page.evaluate(FRAMES)  # the scroll event has been handled and the page painted
            end = overlay_pixels(page)
            drawn = page.evaluate("({...document.getElementById('parsebox').dataset})")
            page.screenshot(path=str(tmp_path / "long_end.png"))
            assert errors == []
        finally:
            chromium.close()
    for place, (dark, coloured) in [("start", start), ("far end", end)]:
        assert dark > 2_000, f"the parse overlay is blank at the {place} ({dark} pixels drawn)"
        assert coloured > 300, f"no predicted parent is drawn at the {place} ({coloured} coloured pixels)"
    assert int(drawn.get("arcs", 0)) > 0 and int(drawn["last"]) == words - 1, drawn  # what the page says it drew
