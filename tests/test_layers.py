"""The package's layers import only downward (README, Layout): the method objects and everything below
them know neither Lightning nor the Hugging Face Trainer, so every adapter can reuse them."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "attnreg"
FRAMEWORKS = ("lightning", "pytorch_lightning", "attnreg.callbacks", "attnreg.mixin", "attnreg.integrations")
APP = ("attnreg.app",)
CORE = [
    "families.py",
    "weights.py",
    "unwrap.py",
    "records.py",
    "keywords.py",
    "eager.py",
    "folding.py",
    "hub.py",
    "heads.py",
    "losses.py",
    "blockwise.py",
    "schedules.py",
    "progress.py",
    "syntax",
    "analysis",
    "structure",
]
LOWER = [*CORE, "methods"]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def files(entry: str) -> list[Path]:
    path = PACKAGE / entry
    return sorted(path.rglob("*.py")) if path.is_dir() else [path]


@pytest.mark.parametrize(
    "path", [p for entry in LOWER for p in files(entry)], ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_lower_layers_import_no_framework_and_no_app(path):
    upward = [
        name
        for name in imported_modules(path)
        if any(name == banned or name.startswith(banned + ".") for banned in FRAMEWORKS + APP)
        or name == "transformers.Trainer"
    ]
    assert not upward, f"{path.relative_to(PACKAGE)} imports {sorted(upward)} from a layer above it"


@pytest.mark.parametrize("path", [p for entry in CORE for p in files(entry)], ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_core_imports_no_method(path):
    upward = [
        name for name in imported_modules(path) if name == "attnreg.methods" or name.startswith("attnreg.methods.")
    ]
    assert not upward, f"{path.relative_to(PACKAGE)} imports {sorted(upward)}: the core sits below the methods"


def test_the_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from attnreg.callbacks.base import MethodCallback\nimport lightning as L\n")
    assert {"attnreg.callbacks.base", "lightning"} <= imported_modules(bad)


ADAPTERS = ["integrations/hf.py", "integrations/hf_events.py", "callbacks/base.py", "callbacks/events.py", "mixin.py"]
ADAPTER_FILES = [p for entry in ("integrations", "callbacks", "mixin.py") for p in files(entry)]


@pytest.mark.parametrize("path", ADAPTER_FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_adapter_imports_pruning(path):
    """The model's structure reaches checkpoints through the runner's structure event, not through pruning
    (`from attnreg.methods import pruning` counts too)."""
    pruning = "attnreg.methods.pruning"
    found = [name for name in imported_modules(path) if name == pruning or name.startswith(pruning + ".")]
    assert not found, f"{path.relative_to(PACKAGE)} imports {sorted(found)}"


OUTSIDE_PRUNING = [  # the package face, methods/__init__.py, gathers every method
    path for path in files("methods") if "pruning" not in path.relative_to(PACKAGE).parts and path.name != "__init__.py"
]


@pytest.mark.parametrize("path", OUTSIDE_PRUNING, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_runner_and_other_methods_import_no_pruning_method(path):
    """What was done to the model's shape is `attnreg.structure`'s, below the methods: the runner reads it there, and
    no method imports another sideways."""
    pruning = "attnreg.methods.pruning"
    found = [name for name in imported_modules(path) if name == pruning or name.startswith(pruning + ".")]
    assert not found, f"{path.relative_to(PACKAGE)} imports {sorted(found)}"


# AttentionLoss is the protocol's term of a function, which the mixin's add_attnreg_term makes
PROTOCOL = {"Method", "Loop", "Runner", "Captured", "AttentionLoss"}


def method_classes_named(path: Path) -> set[str]:
    """The method classes of `attnreg.methods` (other than the protocol's) that a file names."""
    import attnreg.methods

    classes = {name for name in attnreg.methods.__all__ if isinstance(getattr(attnreg.methods, name), type)}
    tree = ast.parse(path.read_text())
    named = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    named |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    named |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    return named & (classes - PROTOCOL)


@pytest.mark.parametrize("entry", ADAPTERS)
def test_adapters_name_no_method(entry):
    """An adapter translates its framework's events into the methods' protocol: it names no method class."""
    assert not method_classes_named(PACKAGE / entry)


def test_the_adapter_check_sees_a_method_class(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from attnreg.methods import Runner, HeadGating\nisinstance(x, methods.SyntaxPriorKL)\n")
    assert method_classes_named(bad) == {"HeadGating", "SyntaxPriorKL"}


def private_names_used(files: list[Path]) -> dict[str, list[str]]:
    """Private attributes (`obj._name`) read in `files` that attnreg itself never defines: names of torch,
    transformers or Lightning, by `file:line`."""
    trees = {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py")) if path.name != "compat.py"}
    defined = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defined.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                defined.add(node.value)  # setattr(module, "_name", ...) and the like
    used: dict[str, list[str]] = {}
    for path in files:
        for node in ast.walk(trees.get(path) or ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else None
            if name and name.startswith("_") and not name.startswith("__") and name not in defined:
                where = path.relative_to(PACKAGE) if path.is_relative_to(PACKAGE) else path
                used.setdefault(name, []).append(f"{where}:{node.lineno}")
    return used


def test_private_names_of_other_libraries_live_in_the_compatibility_module():
    files = [path for path in sorted(PACKAGE.rglob("*.py")) if path.name != "compat.py"]
    assert not private_names_used(files)


def test_the_private_name_check_sees_one(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nstate = torch._C._current_graph_task_id()\n")
    assert set(private_names_used([bad])) == {"_C", "_current_graph_task_id"}
