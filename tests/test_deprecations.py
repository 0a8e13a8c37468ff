"""The deprecation policy (`attnreg.deprecations`, docs/deprecations.md): every old name, module and config that still
works warns with a FutureWarning a user sees, naming its replacement and the release that removes it; no removal
release is the package's version or older (then the old name must go, with its entry); the docs page, the changelog
and every warning site read the one list."""

import ast
import importlib
import pathlib
import sys
import tomllib
import warnings

import pytest

import attnreg
from attnreg import deprecations
from attnreg.deprecations import DEPRECATIONS

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYTHON_DEFAULT_FILTERS = [DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning]


def release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def shown_to_a_user(action) -> tuple[object, list[warnings.WarningMessage]]:
    """What `action()` returns and the warnings it shows under Python's default filters."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        for category in PYTHON_DEFAULT_FILTERS:
            warnings.filterwarnings("ignore", category=category)
        found = action()
    return found, caught


def forget_module(name: str) -> None:
    parent, _, child = name.rpartition(".")
    sys.modules.pop(name, None)
    vars(sys.modules[parent]).pop(child, None)


def new_object(new: str):
    """The object a new name (`attnreg.methods.AttentionLoss`, `attnreg.methods.pruning`) names."""
    try:
        return importlib.import_module(new)
    except ImportError:
        module, _, name = new.rpartition(".")
        return getattr(importlib.import_module(module), name)


def exercise_module(old: str, form: str):
    forget_module(old)
    if form == "import":
        return lambda: (exec(f"import {old}", {}), sys.modules[old])[1]
    if form == "attribute":
        parent, _, child = old.rpartition(".")
        return lambda: getattr(importlib.import_module(parent), child)
    raise AssertionError(form)


def exercise_name(old: str, form: str):
    module, _, name = old.rpartition(".")
    if form == "attribute":
        return lambda: getattr(importlib.import_module(module), name)
    if form == "import":
        return lambda: (exec(f"from {module} import {name} as found", namespace := {}), namespace["found"])[1]
    raise AssertionError(form)


def exercise_config(old: str, form: str):
    from attnreg.app.configs import CONFIG_DIR
    from attnreg.app.settings import warn_renamed

    group, _, name = old.partition("=")
    assert group == "attnreg" and (CONFIG_DIR / group / f"{name}.yaml").exists(), f"{old}: no such config file"
    return lambda: warn_renamed({group: f"[{name}, none]"})


FORMS = {"module": ("import", "attribute"), "name": ("attribute", "import"), "config": ("choice",)}
EXERCISE = {"module": exercise_module, "name": exercise_name, "config": exercise_config}
CASES = [
    pytest.param(entry, spelling, form, id=f"{spelling}-{form}")
    for entry in DEPRECATIONS.values()
    for spelling in (entry.old, *entry.also)
    for form in FORMS.get(entry.kind, ("unknown",))
]


@pytest.mark.parametrize(("entry", "spelling", "form"), CASES)
def test_each_old_name_warns_with_its_replacement_and_removal_release(entry, spelling, form):
    assert entry.kind in EXERCISE, f"{entry.old}: no way to exercise a {entry.kind!r} here (add one)"
    action = EXERCISE[entry.kind](spelling, form)
    try:
        found, caught = shown_to_a_user(action)
    finally:
        if entry.kind == "module":
            forget_module(spelling)
    assert [(w.category, str(w.message)) for w in caught] == [(FutureWarning, deprecations.message(spelling))]
    message = str(caught[0].message)
    assert f"removed in {entry.removed_in}" in message and entry.new in message and spelling in message
    assert not caught[0].filename.startswith(str(ROOT / "attnreg")), caught[0].filename  # points at the user's line
    if entry.kind in ("module", "name"):
        assert found is new_object(entry.new)  # the same object, not a copy
    else:
        assert found == [spelling.partition("=")[2]]


def test_every_removal_release_is_after_the_package_version():
    version = release(attnreg.__version__)
    passed = [entry.old for entry in DEPRECATIONS.values() if release(entry.removed_in) <= version]
    assert not passed, f"attnreg {attnreg.__version__} should have removed {passed} (and their entries)"
    for entry in DEPRECATIONS.values():
        assert release(entry.deprecated_in) <= version < release(entry.removed_in), entry
        assert entry.kind in deprecations.KINDS, entry


def test_the_package_version_is_the_projects():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert attnreg.__version__ == project["version"]


def test_the_docs_page_and_the_changelog_list_every_old_name():
    page = (ROOT / "docs" / "deprecations.md").read_text()
    assert deprecations.markdown_table() in page, "docs/deprecations.md: paste deprecations.markdown_table()"
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{attnreg.__version__}]" in changelog
    missing = [spelling for e in DEPRECATIONS.values() for spelling in (e.old, *e.also) if spelling not in changelog]
    assert not missing, f"CHANGELOG.md does not name {missing}"


def test_no_future_warning_is_raised_outside_the_registry():
    """A FutureWarning built at its own site would say no removal release: every one goes through
    `attnreg.deprecations.warn`."""
    sites = []
    for path in sorted((ROOT / "attnreg").rglob("*.py")):
        if path.name == "deprecations.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and any(
                isinstance(arg, ast.Name) and arg.id == "FutureWarning"
                for arg in [*node.args, *(keyword.value for keyword in node.keywords)]
            ):
                sites.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not sites, f"FutureWarnings raised outside attnreg.deprecations: {sites}"
