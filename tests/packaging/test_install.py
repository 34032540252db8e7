"""What a user gets from `pip install '.[operator]'` in a clean virtualenv.

Installs the checkout (and its operator extra from PyPI) into a new venv, then
runs the installed `kubectl-rekindle` the way kubectl would: every subcommand
answers --help, and `bench --plot` can draw (matplotlib comes with the extra).
"""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

REPO = Path(__file__).resolve().parents[2]
SUBCOMMANDS = ("checkpoint", "restore", "status", "bench")


@pytest.fixture(scope="module")
def operator_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("clean-venv")
    venv.create(root, with_pip=True)
    subprocess.run(
        [
            str(root / "bin" / "pip"),
            "install",
            "-q",
            "--disable-pip-version-check",
            f"{REPO}[operator]",
        ],
        check=True,
        timeout=900,
    )
    return root


def run(venv_root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv_root / "bin" / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=120
    )


def test_kubectl_rekindle_answers_every_subcommand(operator_venv: Path) -> None:
    top = run(operator_venv, "kubectl-rekindle", "--help")
    assert top.returncode == 0, top.stderr
    for sub in SUBCOMMANDS:
        assert sub in top.stdout
        out = run(operator_venv, "kubectl-rekindle", sub, "--help")
        assert out.returncode == 0, f"{sub}: {out.stderr}"
    assert "--plot" in run(operator_venv, "kubectl-rekindle", "bench", "--help").stdout


def test_bench_plot_draws_in_the_clean_install(operator_venv: Path, tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    script = (
        "import dataclasses, sys\n"
        "from rekindle_operator import cluster_bench as b\n"
        "def trial(arm, i):\n"
        "    vals = {'arm': arm, 'trial': i, 'origin': 'booted', 'reason': ''}\n"
        "    for f in dataclasses.fields(b.Trial):\n"
        "        vals.setdefault(f.name, 1.0 + i if arm == 'naive' else 0.1 + i)\n"
        "    return b.Trial(**vals)\n"
        "b.plot([trial(a, i) for a in b.ARMS for i in range(3)], __import__('pathlib')"
        ".Path(sys.argv[1]), 'clean install')\n"
    )
    out = run(operator_venv, "python", "-c", script, str(png))
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_operator_install_does_not_pull_in_torch_or_vllm(operator_venv: Path) -> None:
    script = (
        "import sys, rekindle_operator.handlers, rekindle_operator.kubectl_plugin\n"
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)\n"
        "import importlib.util as u\n"
        "print(u.find_spec('torch') is None, u.find_spec('vllm') is None)\n"
    )
    out = run(operator_venv, "python", "-c", script)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


def test_no_pythonpath_in_the_build_and_test_files() -> None:
    """Installed packages, never PYTHONPATH: the issue's grep, kept true."""
    found = subprocess.run(
        ["grep", "-rln", "PYTHONPATH", "Makefile", "scripts", "images", "tests", ".ci"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert [f for f in found if f != "tests/packaging/test_install.py"] == [], found


def test_the_distribution_name_and_a_missing_kubeconfig(
    operator_venv: Path, tmp_path: Path
) -> None:
    """Installed as rekindle-vllm (the plain name is another project's on the index); with
    no kubeconfig the plugin says so in one line and exits 2, as kubectl users expect."""
    shown = run(operator_venv, "pip", "show", "rekindle-vllm")
    assert shown.returncode == 0 and "Name: rekindle-vllm" in shown.stdout, shown.stderr
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none")}
    out = subprocess.run(
        [str(operator_venv / "bin" / "kubectl-rekindle"), "status", "tiny"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 2, out
    assert out.stderr.startswith("error: no kubeconfig found") and out.stderr.count("\n") == 1, out
