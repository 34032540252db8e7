"""rekindle_dev.gpu_probe's results file: phases skipped for the time budget are in it.

(The phases themselves need an NVIDIA GPU; docs/gpu.md, "On a real GPU".)
"""

from __future__ import annotations

import json
from pathlib import Path

from rekindle_dev import gpu_probe


def test_phases_past_the_budget_are_recorded_as_skipped(tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc = gpu_probe.main(
        ["--out", str(out), "--work", str(tmp_path / "work"), "--phases", "facts,h2d",
         "--budget-s", "0"]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads((out / "gpu-probe.json").read_text())
    assert doc["facts"] == {"skipped": "past the 0.0 s budget"}
    assert doc["h2d"] == {"skipped": "past the 0.0 s budget"}
    assert (out / "gpu-probe-logs.tar.gz").is_file()
