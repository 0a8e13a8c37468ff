"""Griffe extension for the API reference: read a docstring's `Example:` section as `Examples:`.

attnreg's docstrings head their doctest blocks with `Example:`. Griffe's Google-style parser knows only
the plural as an examples section and renders the singular as a plain admonition, whose `>>>` lines
Markdown then takes for nested block quotes. Renaming the heading before the docstring is parsed makes
griffe render each `>>>` block, with its expected output, as Python code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

HEADING = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Turns every `Example:` section heading into `Examples:` (the docstring's text is otherwise kept)."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is not None and "Example:" in docstring.value:
            docstring.value = HEADING.sub(r"\1Examples:", docstring.value)
