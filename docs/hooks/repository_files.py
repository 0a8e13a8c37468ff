"""MkDocs hook: publish the repository files that the docs link to (benchmark results, plots, scripts).

MkDocs builds only what lies under `docs/`, but the evidence lives in `benchmarks/results/`. Pages link
to it with ordinary relative links (`../../benchmarks/results/sst2_pruning/summary.png` from
`docs/methods/pruning.md`), which also work when the Markdown is read on GitHub. This hook follows
those links and adds every file they reach to the site under `repo/<its repository path>`, so that
images show and results pages render; Markdown files reached this way are followed in turn. A link to
a folder goes to its README.md or index.md, or to a generated page listing the folder's files. The
links in every page are rewritten to the published copies.

A link to something the repository does not have is logged as a warning, so `mkdocs build --strict`
fails on a broken reference to evidence just as it does on a broken link between pages.
"""

from __future__ import annotations

import logging
import posixpath
import re
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.pages import Page

log = logging.getLogger("mkdocs.hooks.repository_files")

PREFIX = "repo"  # published repository files live under this folder of the site
INDEX_NAMES = ("README.md", "index.md")
SKIPPED = {"__pycache__", ".git", ".venv"}
INLINE = re.compile(r"(\]\(\s*<?)([^)\s>]+)(>?(?:\s+\"[^\"]*\")?\s*\))")  # [text](target "title"), ![alt](...)
REFERENCE = re.compile(r"^(\s{0,3}\[[^\]]+\]:\s*<?)(\S+?)(>?(?:\s+.*)?)$")  # [label]: target
FENCE = re.compile(r"^\s*(```|~~~)")

_folder_pages: dict[str, str] = {}  # repository folder -> src_uri of the page that stands for it


def _root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


def _docs_folder(config: MkDocsConfig) -> str:
    return Path(config.docs_dir).resolve().relative_to(_root(config)).as_posix()


def _to_src(repo_path: str, docs: str) -> str:
    """The site's src_uri of a repository path."""
    if repo_path.startswith(docs + "/"):
        return repo_path[len(docs) + 1 :]
    return f"{PREFIX}/{repo_path}"


def _to_repo(src_uri: str, docs: str) -> str:
    """The repository path of a site src_uri."""
    if src_uri.startswith(PREFIX + "/"):
        return src_uri[len(PREFIX) + 1 :]
    return f"{docs}/{src_uri}"


def _relative_target(link: str) -> tuple[str, str] | None:
    """(path, the rest: ?query#fragment) of a relative link to a file or folder, else None."""
    scheme, netloc, path, query, fragment = urlsplit(link)
    if scheme or netloc or not path or path.startswith("/"):
        return None
    rest = (f"?{query}" if query else "") + (f"#{fragment}" if fragment else "")
    return unquote(path), rest


def _map_links(markdown: str, change: Callable[[str], str]) -> str:
    """`markdown` with `change` applied to the target of every inline link, image and reference
    definition outside fenced code blocks."""
    lines, fenced = [], False
    for line in markdown.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            line = INLINE.sub(lambda m: m.group(1) + change(m.group(2)) + m.group(3), line)
            line = REFERENCE.sub(lambda m: m.group(1) + change(m.group(2)) + m.group(3), line)
        lines.append(line)
    return "\n".join(lines)


def _links(markdown: str) -> list[str]:
    found: list[str] = []
    _map_links(markdown, lambda link: found.append(link) or link)
    return found


def _listing(folder: str, root: Path) -> str:
    """A page listing the files under a repository folder, each linked (relative to the folder)."""
    entries = sorted(
        path.relative_to(root / folder).as_posix()
        for path in (root / folder).rglob("*")
        if path.is_file() and not SKIPPED.intersection(path.parts)
    )
    lines = [f"# `{folder}/`", "", "Files in this folder of the repository:", ""]
    lines += [f"- [`{entry}`]({entry})" for entry in entries]
    return "\n".join(lines) + "\n"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add every repository file reached by a link from a page (and from pages so added)."""
    root, docs = _root(config), _docs_folder(config)
    _folder_pages.clear()
    queue: list[tuple[str, str]] = []  # (repository path of a Markdown page, its text)
    for file in files.documentation_pages():
        queue.append((_to_repo(file.src_uri, docs), Path(file.abs_src_path).read_text(encoding="utf-8")))
    seen: set[str] = set()

    def publish(repo_path: str, content: str | None = None) -> None:
        src_uri = _to_src(repo_path, docs)
        if files.get_file_from_path(src_uri) is not None:
            return
        source = {"content": content} if content is not None else {"abs_src_path": str(root / repo_path)}
        file = File.generated(config, src_uri, inclusion=InclusionLevel.NOT_IN_NAV, **source)
        files.append(file)
        if repo_path.endswith(".md"):
            queue.append((repo_path, content if content is not None else (root / repo_path).read_text("utf-8")))

    while queue:
        page, text = queue.pop()
        for link in _links(text):
            target = _relative_target(link)
            if target is None:
                continue
            repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(page), target[0]))
            if repo_path == docs or repo_path.startswith(docs + "/") or repo_path in seen:
                continue  # pages of the docs are MkDocs's own business
            seen.add(repo_path)
            path = root / repo_path
            if repo_path.startswith("../") or not path.exists():
                log.warning("'%s' links to '%s', which is not in the repository", page, link)
            elif path.is_file():
                publish(repo_path)
            elif path.is_dir():
                index = next((name for name in INDEX_NAMES if (path / name).is_file()), None)
                if index is None:
                    publish(f"{repo_path}/index.md", _listing(repo_path, root))
                    index = "index.md"
                else:
                    publish(f"{repo_path}/{index}")
                _folder_pages[repo_path] = _to_src(f"{repo_path}/{index}", docs)
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Point every link that leaves the docs (or comes from a published file) at the published copy."""
    docs = _docs_folder(config)
    here = _to_repo(page.file.src_uri, docs)
    folder = posixpath.dirname(page.file.src_uri) or "."

    def change(link: str) -> str:
        target = _relative_target(link)
        if target is None:
            return link
        repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(here), target[0]))
        if repo_path in _folder_pages:
            src_uri = _folder_pages[repo_path]
        elif files.get_file_from_path(_to_src(repo_path, docs)) is not None:
            src_uri = _to_src(repo_path, docs)
        else:
            return link  # missing: on_files warned, or MkDocs will
        return posixpath.relpath(src_uri, folder) + target[1]

    return _map_links(markdown, change)
