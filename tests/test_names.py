"""The names of the release before still work, each with a warning naming the new one (a FutureWarning where a
user would not see a DeprecationWarning: moved modules and config names)."""

import importlib
import sys
import warnings

import pytest
from hydra import compose, initialize_config_dir

import attnreg
from attnreg import methods
from attnreg.app.configs import CONFIG_DIR
from attnreg.app.settings import RENAMED_CONFIGS, warn_renamed


@pytest.mark.parametrize("old", sorted(methods.RENAMED))
def test_an_old_method_name_warns_and_is_the_new_class(old):
    shown = shown_to_a_user(lambda: getattr(methods, old))  # under Python's default filters, from a user's module
    new = methods.RENAMED[old]
    assert shown == [
        f"FutureWarning: attnreg.methods.{old} is deprecated: use attnreg.methods.{new} (the same method); it will be "
        "removed in 0.3.0"
    ]
    with pytest.warns(
        FutureWarning, match=f"attnreg.methods.{old} is deprecated: use attnreg.methods.{methods.RENAMED[old]}"
    ):
        found = getattr(methods, old)
    assert found is getattr(methods, methods.RENAMED[old])


PYTHON_DEFAULT_FILTERS = [  # what `python script.py` starts with (no -W, no PYTHONWARNINGS), last first
    ("ignore", ResourceWarning),
    ("ignore", ImportWarning),
    ("ignore", PendingDeprecationWarning),
    ("ignore", DeprecationWarning),
]


def shown_to_a_user(action) -> list[str]:
    """The warnings that `action()` shows under Python's default filters, called from a user's module."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        for what, category in PYTHON_DEFAULT_FILTERS:
            warnings.filterwarnings(what, category=category)
        action()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def forget(old: str) -> None:
    sys.modules.pop(f"attnreg.{old}", None)
    vars(attnreg).pop(old, None)


FORMS = {
    "from attnreg.X import name": lambda old: exec(f"from attnreg.{old} import {FIRST_NAME[old]}", {}),
    "import attnreg.X": lambda old: exec(f"import attnreg.{old}", {}),
    "attnreg.X": lambda old: getattr(attnreg, old),
    "importlib": lambda old: importlib.import_module(f"attnreg.{old}"),
}
FIRST_NAME = {"pruning": "save_pruned", "optim": "layerwise_param_groups", "distill": "Distillation"}
FIRST_NAME["configs"] = "CONFIG_DIR"


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("old", sorted(attnreg.MOVED))
def test_a_moved_module_works_in_every_form_with_a_warning_a_user_sees(old, form):
    forget(old)
    try:
        assert shown_to_a_user(lambda: FORMS[form](old)) == [
            f"FutureWarning: attnreg.{old} is deprecated: use {attnreg.MOVED[old]} (the same module); it will be "
            "removed in 0.3.0"
        ]
        new = importlib.import_module(attnreg.MOVED[old])
        assert sys.modules[f"attnreg.{old}"] is new and getattr(attnreg, old) is new  # the same module, not a copy
        exec(f"from attnreg.{old} import {FIRST_NAME[old]} as found", namespace := {})
        assert namespace["found"] is getattr(new, FIRST_NAME[old])
    finally:
        forget(old)


def test_a_hydra_searchpath_to_the_old_configs_package_still_finds_them_with_a_warning(tmp_path):
    forget("configs")
    (tmp_path / "app.yaml").write_text(
        "hydra:\n  searchpath: [pkg://attnreg.configs]\ndefaults:\n  - _self_\n  - attnreg: syntax_prior_kl\n"
    )

    def compose_app():
        with initialize_config_dir(str(tmp_path), version_base="1.3"):
            return compose("app")

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = compose_app()
        assert cfg.attnreg.syntax_prior_kl._target_ == "attnreg.SyntaxPriorKL"
        assert any("attnreg.configs is deprecated" in str(w.message) and w.category is FutureWarning for w in caught)
    finally:
        forget("configs")


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
    shown = shown_to_a_user(lambda: warn_renamed({"attnreg": f"[{old}, head_gating]"}))
    assert shown == [
        f"FutureWarning: attnreg={old} is deprecated: use attnreg={new} (the same config under the method's name); "
        "it will be removed in 0.3.0"
    ]
