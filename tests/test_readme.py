"""Every Python snippet of README.md and docs/*.md runs as written (CPU here; the snippets pick CUDA
when present), and every relative link of those files points at a file (and heading) that exists.

A snippet whose first line is ``# needs: cuda`` runs only where CUDA is available."""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPETS = [
    (page, index, code)
    for page in PAGES
    for index, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))
]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_the_readme_and_docs_have_snippets():
    assert sum(page.name == "README.md" for page, _, _ in SNIPPETS) >= 4
    assert {page.name for page, _, _ in SNIPPETS} >= {"README.md", "verify.md", "trees.md", "hf_driver.md"}


@pytest.mark.parametrize("page, index, code", SNIPPETS, ids=[f"{_name(p)}:{i}" for p, i, _ in SNIPPETS])
def test_snippet_runs(page, index, code):
    if code.startswith("# needs: cuda") and not torch.cuda.is_available():
        pytest.skip("the snippet needs a CUDA GPU")
    exec(compile(code, f"{_name(page)} snippet {index}", "exec"), {"__name__": "readme"})


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
            broken.append(target)
    assert not broken, f"{_name(page)}: broken links {broken}"
