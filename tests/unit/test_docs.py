"""The docs: each page says which release it describes, and the README's index lists
every page once, under the user's path or under how Rekindle works."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rekindle_dev.docs_release import release_line

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted((REPO / "docs").glob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_page_says_which_release_it_describes(page: Path) -> None:
    lines = page.read_text().split("\n")
    assert lines[0].startswith("# ") and lines[2] == release_line(REPO), lines[:3]


def test_the_readme_indexes_every_page_once() -> None:
    readme = (REPO / "README.md").read_text()
    index = readme.split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    linked = re.findall(r"\]\((docs/[\w-]+\.md)\)", index)
    assert sorted(linked) == sorted(f"docs/{p.name}" for p in PAGES)
    assert len(linked) == len(set(linked))
    # The user's path comes first, apart from the internals.
    users, internals = index.split("### How it works", 1)
    assert "### Using Rekindle" in users
    assert "docs/user-guide.md" in users and "docs/architecture.md" in internals
