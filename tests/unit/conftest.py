"""Unit-suite fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from rekindle_agent.process_tree import reaper


@pytest.fixture(autouse=True)
def stop_every_reaper(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every Reaper a test makes (an Agent makes one) is stopped when the test ends.

    A Reaper left running reaps zombie children of the pytest process after its
    grace and scans /proc while it lives: a later test's subprocess must find
    its own child's exit status, and the suite's time is its own.
    """
    made: list[reaper.Reaper] = []
    init = reaper.Reaper.__init__

    def tracked(self: reaper.Reaper, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(reaper.Reaper, "__init__", tracked)
    yield
    for r in made:
        r.stop()
