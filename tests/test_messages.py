"""Names attnreg no longer has say what replaces them, in every form users write them (issue 46, item 14); the
app's small commands say what is wrong instead of a traceback (item 20)."""

import importlib

import pytest

import attnreg

FORMS = {
    "attribute": lambda name: getattr(attnreg, name),
    "from-import": lambda name: exec(f"from attnreg import {name}", {}),
}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize(
    "name, replacement",
    [
        ("AttentionEntropy", "attnreg.EntropyRegularizer"),
        ("AttentionPriorKL", "attnreg.SyntaxPriorKL"),
        ("Distiller", "attnreg.Distillation"),
    ],
)
def test_a_removed_name_names_what_replaces_it(name, replacement, form):
    with pytest.raises(ImportError, match=f"attnreg.{name} was removed: use {replacement}"):
        FORMS[form](name)


def test_the_apps_distiller_names_the_distillation_method():
    modules = importlib.import_module("attnreg.app.modules")
    with pytest.raises(ImportError, match=r"attnreg.app.modules.Distiller was removed: use .*attnreg.Distillation"):
        exec("from attnreg.app.modules import Distiller", {})
    assert not hasattr(modules, "NotAName")  # other missing names stay AttributeErrors


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'NotAName'"):
        attnreg.NotAName  # noqa: B018


def test_collect_with_a_baseline_on_a_sweep_of_one_group_says_why_instead_of_a_traceback(tmp_path, capsys):
    import json

    from attnreg.app.collect import main

    for job, seed in [("0", 0), ("1", 1)]:
        (tmp_path / job / ".hydra").mkdir(parents=True)
        (tmp_path / job / ".hydra" / "overrides.yaml").write_text(f"- seed={seed}\n- attnreg.x.weight=0\n")
        (tmp_path / job / "summary.json").write_text(json.dumps({"accuracy": {"val": 0.5 + seed / 10}}))
    with pytest.raises(SystemExit) as stopped:
        main([str(tmp_path), "--baseline", "attnreg.x.weight=0"])
    assert stopped.value.code == 2
    assert "the sweep has one group (only seed varies)" in capsys.readouterr().err
