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
