"""A built-in method is declared once (`attnreg.methods.registry`), and every promise of its entry holds: one name for
its class, its drop-in Lightning callback, its Hydra config file and its log key; the callback, the config and the
docs page exist; it is public under its name. The rest of the package reads the entry (the callbacks are made from
it, the app reads its flags)."""

import pickle
import re
from pathlib import Path

import lightning as L
import pytest
import yaml

import attnreg
from attnreg import callbacks, methods
from attnreg.app.configs import CONFIG_DIR
from attnreg.app.settings import protect_supervised, removes_heads
from attnreg.callbacks.base import DROP_INS, MethodCallback, drop_in_callback
from attnreg.methods.registry import ENTRIES, entry_of, method_entries, register_method

ROOT = Path(__file__).resolve().parents[1]
ENTRIES_NOW = method_entries()


def snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def every_subclass(cls: type) -> set[type]:
    return {sub for direct in cls.__subclasses__() for sub in {direct, *every_subclass(direct)}}


@pytest.mark.parametrize("entry", ENTRIES_NOW, ids=lambda entry: entry.name)
def test_an_entry_has_one_name_in_class_callback_config_and_logs(entry):
    assert entry.name == snake(entry.callback) == entry.method_class.default_name  # its log key: attnreg/<name>
    assert getattr(methods, entry.callback) is entry.method_class and entry.callback in methods.__all__
    callback = getattr(attnreg, entry.callback)
    assert callback is getattr(callbacks, entry.callback) and entry.callback in attnreg.__all__
    assert issubclass(callback, MethodCallback) and callback.method_class is entry.method_class
    assert callback.__qualname__ == entry.callback  # Lightning's checkpoint key starts with it


@pytest.mark.parametrize("entry", ENTRIES_NOW, ids=lambda entry: entry.name)
def test_an_entry_has_its_config_exactly_when_it_says(entry):
    config = CONFIG_DIR / "attnreg" / f"{entry.name}.yaml"
    assert config.exists() == entry.config
    if entry.config:
        node = yaml.safe_load(config.read_text())
        assert list(node) == [entry.name] and node[entry.name]["_target_"] == f"attnreg.{entry.callback}"


@pytest.mark.parametrize("entry", ENTRIES_NOW, ids=lambda entry: entry.name)
def test_an_entry_has_its_docs_page_which_names_it(entry):
    page = ROOT / "docs" / entry.docs
    text = page.read_text()
    assert entry.callback in text
    if entry.config:
        assert f"attnreg={entry.name}" in text
    assert f": {entry.docs}" in (ROOT / "mkdocs.yml").read_text()  # in the site's navigation


def test_every_method_class_of_attnreg_is_declared():
    """A method class written in attnreg/methods/ without `@register_method` would have no callback, no config
    check and no export: only the protocol's bases are left out."""
    built_in = {cls for cls in every_subclass(methods.Method) if cls.__module__.startswith("attnreg.methods.")}
    assert built_in - {entry.method_class for entry in ENTRIES_NOW} == {methods.LossTerm}


def test_the_app_reads_the_flags_of_the_entries():
    flagged = {entry.callback for entry in ENTRIES_NOW if entry.removes_heads}
    assert flagged == {"HeadGating", "ImportanceRemoval"}
    assert removes_heads([attnreg.HeadGating()]) and not removes_heads([attnreg.EntropyRegularizer(), L.Callback()])

    class Gates(methods.HeadGating):  # a subclass of a built-in method is read as the built-in
        pass

    gating = MethodCallback(Gates())
    assert entry_of(gating.method).name == "head_gating" and removes_heads([gating])
    from attnreg.tiny import tiny_model

    assert protect_supervised([attnreg.SyntaxPriorKL(heads=[1]), gating], tiny_model("bert")) == {0: [1], 1: [1]}
    assert gating.method.removal.protect == {0: (1,), 1: (1,)}


def test_a_drop_in_callback_pickles_and_keeps_its_checkpoint_key():
    entropy = attnreg.EntropyRegularizer(mode="max", weight=0.1, layers=[0])
    again = pickle.loads(pickle.dumps(entropy))
    assert type(again) is attnreg.EntropyRegularizer and again.method.mode == "max"
    assert entropy.state_key.startswith("EntropyRegularizer{")
    from attnreg.callbacks.regularizers import EntropyRegularizer  # the module of earlier releases

    assert EntropyRegularizer is attnreg.EntropyRegularizer


def test_a_method_declared_later_gets_its_callback_and_a_taken_name_is_refused():
    @register_method(docs="methods/your-own.md", config=False)
    class Sharpen(methods.Method):
        default_name = "sharpen"

    try:
        callback = drop_in_callback(Sharpen)
        assert callback.__name__ == "Sharpen" and isinstance(callback(name="s").method, Sharpen)
        assert drop_in_callback(Sharpen) is callback
        with pytest.raises(ValueError, match="the method name 'sharpen' is Sharpen's"):

            @register_method(docs="methods/your-own.md")
            class Other(methods.Method):
                default_name = "sharpen"

    finally:
        ENTRIES.pop("sharpen")
        DROP_INS.pop(Sharpen, None)
    with pytest.raises(TypeError, match="Sharpen is not a built-in method: run it with MethodCallback"):
        drop_in_callback(Sharpen)
