"""docs/hub.md's family table is `attnreg.families.families_markdown()`, verbatim, so it cannot go stale: a family
added, changed or refused in `attnreg/families.py` fails here until it is rendered again (the README links to it)."""

from pathlib import Path

import pytest

from attnreg.families import FAMILIES, REFUSED, families_markdown

ROOT = Path(__file__).resolve().parent.parent
BEGIN = (
    "<!-- families_markdown() begins: generated from attnreg/families.py, tests/test_families_table.py checks it -->"
)
END = "<!-- families_markdown() ends -->"


@pytest.mark.parametrize("path", ["docs/hub.md"])
def test_the_family_tables_are_rendered_from_the_table(path):
    text = (ROOT / path).read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{path} lost the markers around its family table"
    start = text.index(BEGIN) + len(BEGIN) + 1
    assert text[start : text.index(END)] == families_markdown(), (
        f"{path}'s family table is stale: replace the lines between the markers with the output of "
        "`.venv/bin/python -c 'from attnreg.families import families_markdown; print(families_markdown(), end=\"\")'`"
    )


def test_every_family_and_every_refusal_has_a_row():
    rows = families_markdown().splitlines()
    assert sum(row.startswith(f"| {family.name} |") for family in FAMILIES for row in rows) == len(FAMILIES)
    assert sum(row.startswith(f"| `{model_type}` |") for model_type in REFUSED for row in rows) == len(REFUSED)
    assert all(row.count(" | ") == 9 for row in rows[2 : 2 + len(FAMILIES)])  # no stray pipe in a cell
