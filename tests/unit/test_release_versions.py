"""One version for everything a release ships: the Python distribution, the chart
(version and appVersion), the agent that records it in every manifest, and the
CHANGELOG's heading for it."""

from __future__ import annotations

import tomllib
from pathlib import Path

import rekindle_agent
import rekindle_contract
import yaml

REPO = Path(__file__).resolve().parents[2]


def test_one_version_everywhere() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    chart = yaml.safe_load((REPO / "charts" / "rekindle" / "Chart.yaml").read_text())
    version = project["version"]
    assert chart["version"] == version and chart["appVersion"] == version
    assert rekindle_agent.__version__ == version
    # The installed distribution's metadata (what the operator and agents report).
    assert project["name"] == rekindle_contract.DISTRIBUTION
    assert rekindle_contract.__version__ == version
    assert f"({version})" in (REPO / "CHANGELOG.md").read_text().split("\n## ", 2)[1].split("\n")[0]
