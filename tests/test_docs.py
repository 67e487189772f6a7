"""The docs stay a reference: no page of docs/ over 20 KB, the README under 10 KB, and every link to a
page or to one of its headings (README.md and docs/ as markdown links, the code's comments as
`docs/X.md#anchor`) reaches a file that exists and a heading it has, by GitHub's anchor rules."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.unit

DOCS = REPO / "docs"
README = REPO / "README.md"
PAGE_LIMIT = 20 * 1024
README_LIMIT = 10 * 1024
PAGES = sorted(DOCS.glob("*.md"))
# Where the code names a docs page in a comment or a docstring.
CODE = [*REPO.glob("*.yaml"), REPO / "Makefile", *REPO.glob("requirements*.in"),
        *(p for d in ("app", "bench", "scripts", "docker", "tests") for p in (REPO / d).rglob("*")
          if p.is_file() and p.suffix in (".py", ".sh", ".md", ".sbatch", "") and "__pycache__" not in p.parts
          and p != Path(__file__).resolve())]

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
NAMED = re.compile(r"\bdocs/([\w.-]+\.md)(#[\w-]+)?")


def anchor(heading: str) -> str:
    """GitHub's id for a heading: its text as rendered (links to their text, no code marks or
    emphasis), lowercased, every character but letters, digits, '_', '-' and spaces dropped, spaces
    to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's id on a page, the repeats numbered as GitHub numbers them (-1, -2, ...)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading and not fenced:
            base = anchor(heading[1])
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    """The relative link targets of a markdown page, outside its code blocks and code spans."""
    targets: list[str] = []
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            targets += [t for t in LINK.findall(re.sub(r"`[^`]*`", "", line))
                        if not re.match(r"[a-z]+:", t)]
    return targets


def broken(source: Path, target: str) -> str | None:
    """Why `target`, as written in `source`, leads nowhere; None when it reaches its page and heading."""
    path, _, fragment = target.partition("#")
    page = (source.parent / path).resolve() if path else source
    if not page.exists():
        return f"{source.relative_to(REPO)}: {target}: no such file"
    if fragment and page.suffix == ".md" and fragment not in anchors(page):
        return f"{source.relative_to(REPO)}: {target}: {page.name} has no heading #{fragment}"
    return None


def test_the_anchor_rule_is_githubs():
    assert anchor("Where a job's time went, the stacks of a hang, and restarts without progress") == \
        "where-a-jobs-time-went-the-stacks-of-a-hang-and-restarts-without-progress"
    assert anchor("Measured on one GPU (H200, 2026-11-26)") == "measured-on-one-gpu-h200-2026-11-26"
    assert anchor("`make chaos`: the [kinds](x.md)") == "make-chaos-the-kinds"
    assert anchor("NCCL on GPU hosts") == "nccl-on-gpu-hosts"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_of_the_docs_is_over_20_kb(page):
    assert page.stat().st_size <= PAGE_LIMIT, (
        f"docs/{page.name} is {page.stat().st_size} bytes, over {PAGE_LIMIT}: move how its figures were "
        "found to docs/history.md, or split the page")


def test_the_readme_stays_under_10_kb():
    assert README.stat().st_size <= README_LIMIT, f"README.md is {README.stat().st_size} bytes, over {README_LIMIT}"


def test_every_link_of_the_readme_and_the_docs_reaches_its_page_and_heading():
    missing = [why for page in [README, *PAGES] for target in links(page) if (why := broken(page, target))]
    assert not missing, "\n".join(missing)


def test_every_docs_page_the_code_names_exists_with_its_heading():
    missing = []
    for source in CODE:
        try:
            text = source.read_text()
        except UnicodeDecodeError:
            continue
        for name, fragment in NAMED.findall(text):
            target = DOCS / name
            if not target.exists():
                missing.append(f"{source.relative_to(REPO)}: docs/{name}: no such file")
            elif fragment and fragment[1:] not in anchors(target):
                missing.append(f"{source.relative_to(REPO)}: docs/{name}{fragment}: no such heading")
    assert not missing, "\n".join(missing)
