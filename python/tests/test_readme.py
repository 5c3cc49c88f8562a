"""The README's tour runs as written: each ``python`` block of its "A
ten-minute tour" section, run in order in one namespace from the
repository root, prints exactly the ``text`` block that follows it. The
answers themselves are checked against xarray by the other tests; this
keeps the front page honest."""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def tour_blocks() -> list[tuple[str, str]]:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## A ten-minute tour")
    end = readme.index("\n## ", start + 1)
    pairs = re.findall(r"```python\n(.*?)```\n```text\n(.*?)```", readme[start:end], re.S)
    assert len(pairs) >= 2, "the tour lost its Python examples"
    return pairs


def test_the_readme_tour_prints_what_it_shows():
    namespace: dict = {}
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for code, shown in tour_blocks():
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
            assert out.getvalue() == shown, f"README block:\n{code}\nprinted:\n{out.getvalue()}"
    finally:
        os.chdir(cwd)


LINK = re.compile(r"\]\(([^)\s]+)\)")


def heading_anchors(page: pathlib.Path) -> set[str]:
    """The anchors GitHub gives a page's headings (lower case, punctuation
    other than hyphens dropped, spaces as hyphens; fenced code skipped)."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_every_docs_page_is_linked_from_the_readme_and_every_link_resolves():
    readme = ROOT / "README.md"
    pages = [readme, *sorted((ROOT / "docs").glob("*.md"))]
    linked = {(ROOT / target.split("#")[0]).resolve() for target in LINK.findall(readme.read_text())}
    unlinked = [p.name for p in pages[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link to: {unlinked}"
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)
