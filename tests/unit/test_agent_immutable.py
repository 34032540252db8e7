"""remove_tree when another remover (a second cleanup Job) deletes parts of the tree first."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from rekindle_agent.mapped_files import immutable


def test_remove_tree_tolerates_a_concurrent_remover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    for sub in ("a", "b", "c"):
        (root / sub / "deep").mkdir(parents=True)
        for i in range(3):
            (root / sub / "deep" / f"f{i}").write_bytes(b"x")
        (root / sub / "g").write_bytes(b"y")
    real_unlink = os.unlink
    raced: list[str] = []

    def racing_unlink(path: os.PathLike[str] | str, *a: object, **k: object) -> None:
        # The other remover takes every subdirectory, before our first unlink.
        if not raced:
            raced.append(str(path))
            subprocess.run(["rm", "-rf", *(str(root / s) for s in ("a", "b", "c"))], check=True)
        real_unlink(path, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", racing_unlink)
    immutable.remove_tree(root)
    assert raced, "the race was not staged"
    assert not (root / "a").exists()
    assert not root.exists()
