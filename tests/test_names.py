"""One name per method: its method class, its drop-in Lightning callback, its Hydra config file and its log key
agree; the names of the release before still work, each with a DeprecationWarning naming the new one."""

import re
import warnings

import pytest
import yaml
from hydra import compose, initialize_config_dir

import attnreg
from attnreg import methods
from attnreg.app.configs import CONFIG_DIR
from attnreg.app.settings import RENAMED_CONFIGS, warn_renamed
from attnreg.methods.base import Method

METHODS = [name for name in methods.__all__ if isinstance(getattr(methods, name), type)]
METHOD_CLASSES = [
    getattr(methods, name)
    for name in METHODS
    if issubclass(getattr(methods, name), Method) and getattr(methods, name) not in (Method, methods.LossTerm)
]
WITHOUT_CONFIG = {"AttentionLoss", "Distillation", "FreezeLayers", "HeadImportance"}  # they take objects


def snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


@pytest.mark.parametrize("method", METHOD_CLASSES, ids=lambda m: m.__name__)
def test_a_method_has_one_name_in_class_callback_config_and_logs(method):
    assert method.default_name == snake(method.__name__)  # its log key: attnreg/<default_name>
    callback = getattr(attnreg, method.__name__)
    assert callback.method_class is method
    config = CONFIG_DIR / "attnreg" / f"{method.default_name}.yaml"
    if method.__name__ in WITHOUT_CONFIG:
        assert not config.exists()
        return
    node = yaml.safe_load(config.read_text())
    assert list(node) == [method.default_name] and node[method.default_name]["_target_"] == f"attnreg.{method.__name__}"


@pytest.mark.parametrize("old", sorted(methods.RENAMED))
def test_an_old_method_name_warns_and_is_the_new_class(old):
    with pytest.warns(
        DeprecationWarning, match=f"attnreg.methods.{old} is deprecated: use attnreg.methods.{methods.RENAMED[old]}"
    ):
        found = getattr(methods, old)
    assert found is getattr(methods, methods.RENAMED[old])


@pytest.mark.parametrize("old", sorted(attnreg.MOVED))
def test_a_moved_module_warns_and_is_the_new_module(old):
    with pytest.warns(DeprecationWarning, match=f"attnreg.{old} is deprecated: use {attnreg.MOVED[old]}"):
        module = getattr(attnreg, old)
    assert module.__name__ == attnreg.MOVED[old]


def test_unknown_names_still_raise():
    with pytest.raises(AttributeError, match="has no attribute 'Entropie'"):
        methods.Entropie  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'prunning'"):
        attnreg.prunning  # noqa: B018


@pytest.mark.parametrize("old", sorted(RENAMED_CONFIGS))
def test_an_old_config_name_composes_the_new_one_and_warns(old):
    new = RENAMED_CONFIGS[old]
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        before, after = compose("train", [f"attnreg={old}"]), compose("train", [f"attnreg={new}"])
    assert before.attnreg == after.attnreg and before.get("module") == after.get("module")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert warn_renamed({"attnreg": f"[{old}, head_gating]"}) == [old]
    assert [str(w.message) for w in caught] == [
        f"attnreg={old} is deprecated: use attnreg={new} (the same config under the method's name)"
    ]
