"""Which release the docs describe: one line under each page's title.

The version is the project's (pyproject.toml); "unreleased" while the
CHANGELOG's newest section is still "Unreleased". tests/unit/test_docs.py
checks every page carries the line; `rekindle-dev bench report` writes it into
the generated benchmarks page.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def release_line(repo: Path = REPO) -> str:
    version = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["version"]
    newest = (repo / "CHANGELOG.md").read_text().split("\n## ", 1)[1].split("\n", 1)[0]
    state = "unreleased" if newest.lower().startswith("unreleased") else "released"
    return (
        f"_This page describes Rekindle {version} ({state}; see [CHANGELOG.md](../CHANGELOG.md))._"
    )
