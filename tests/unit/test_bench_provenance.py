"""Whether a results file still describes the code: its commit against HEAD, in a real git repo."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from rekindle_dev import bench_provenance as prov

MEASURED = ("src/bench.py", "src/agent")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def commit_all(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository with measured code (src/bench.py, src/agent/) and code nobody measures."""
    r = tmp_path / "repo"
    (r / "src" / "agent").mkdir(parents=True)
    (r / "src" / "bench.py").write_text("x = 1\n")
    (r / "src" / "agent" / "a.py").write_text("y = 1\n")
    (r / "docs").mkdir()
    (r / "docs" / "guide.md").write_text("words\n")
    git(r, "init", "-q")
    commit_all(r, "first")
    return r


def doc_at(commit: str, **extra: object) -> dict[str, object]:
    return {"commit": commit, "date": "2026-11-25T10:00:00Z", "measured_paths": MEASURED, **extra}


def test_a_file_from_head_is_current(repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    st = prov.check(doc_at(head), "docs/bench/x.json", repo)
    assert st.label == "current" and st.current and st.stale == ()
    assert st.cite() == f"`docs/bench/x.json` (commit {head[:10]}, 2026-11-25T10:00:00Z)"


def test_changes_outside_the_measured_paths_keep_it_current(repo: Path) -> None:
    old = git(repo, "rev-parse", "HEAD")
    (repo / "docs" / "guide.md").write_text("more words\n")
    commit_all(repo, "docs")
    (repo / "docs" / "guide.md").write_text("uncommitted words\n")
    assert prov.check(doc_at(old), "x.json", repo).current


def test_a_readme_inside_a_measured_directory_keeps_it_current(repo: Path) -> None:
    """Documentation measures nothing, committed or not."""
    old = git(repo, "rev-parse", "HEAD")
    (repo / "src" / "agent" / "README.md").write_text("how the agent works\n")
    commit_all(repo, "agent docs")
    (repo / "src" / "agent" / "README.md").write_text("more\n")
    assert prov.check(doc_at(old), "x.json", repo).current


def test_measured_code_committed_since_makes_it_stale_and_names_the_files(repo: Path) -> None:
    old = git(repo, "rev-parse", "HEAD")
    (repo / "src" / "agent" / "a.py").write_text("y = 2\n")
    (repo / "src" / "agent" / "new.py").write_text("z = 1\n")
    commit_all(repo, "agent change")
    st = prov.check(doc_at(old), "x.json", repo)
    assert st.label == "STALE" and not st.current
    assert st.stale == (
        f"measured code changed since {old[:10]}: src/agent/a.py, src/agent/new.py",
    )
    assert st.cite().endswith("; **STALE**)")


def test_uncommitted_and_untracked_changes_to_measured_code_make_it_stale(repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    (repo / "src" / "bench.py").write_text("x = 2\n")
    st = prov.check(doc_at(head), "x.json", repo)
    assert st.stale == ("measured code has uncommitted changes now: src/bench.py",)
    git(repo, "checkout", "-q", "--", "src/bench.py")
    (repo / "src" / "agent" / "extra.py").write_text("new\n")
    st = prov.check(doc_at(head), "x.json", repo)
    assert st.stale == ("measured code has uncommitted changes now: src/agent/extra.py",)


def test_many_changed_files_are_counted_not_all_named(repo: Path) -> None:
    old = git(repo, "rev-parse", "HEAD")
    for i in range(6):
        (repo / "src" / "agent" / f"m{i}.py").write_text("1\n")
    commit_all(repo, "six")
    (reason,) = prov.check(doc_at(old), "x.json", repo).stale
    assert reason.endswith("src/agent/m3.py (+2 more)")


def test_no_commit_or_an_unknown_one_is_stale(repo: Path) -> None:
    st = prov.check({"date": "d"}, "x.json", repo)
    assert st.stale == ("no commit recorded: nothing shows which code it measured",)
    assert st.cite() == "`x.json` (no commit recorded, d; **STALE**)"
    st = prov.check(doc_at("0" * 40), "x.json", repo)
    assert st.stale == ("commit 0000000000 is not in this repository",)


def test_a_dirty_tree_is_marked_even_where_nothing_changed_since(repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD")
    st = prov.check(doc_at(head, dirty=True), "x.json", repo)
    assert st.label == "DIRTY TREE" and not st.current
    assert st.why() == "made from a working tree with uncommitted changes to its measured code"


def test_default_measured_paths_apply_where_the_file_records_none(repo: Path) -> None:
    old = git(repo, "rev-parse", "HEAD")
    (repo / "src" / "bench.py").write_text("x = 3\n")
    commit_all(repo, "bench")
    doc = {"commit": old}
    assert prov.check(doc, "x.json", repo, default=("docs",)).current  # MEASURED_ALWAYS absent
    assert not prov.check(doc, "x.json", repo, default=("src/bench.py",)).current


def test_recover_takes_the_commit_that_last_wrote_the_file(repo: Path) -> None:
    res = repo / "docs" / "bench" / "kv" / "results.json"
    res.parent.mkdir(parents=True)
    res.write_text(json.dumps({"command": "rekindle-dev bench kv", "summary": {}}))
    first = commit_all(repo, "results")
    res.write_text(json.dumps({"command": "rekindle-dev bench kv", "date": "2026-11-24 05:00 UTC"}))
    second = commit_all(repo, "results again")
    assert first != second
    assert prov.recover(res, ("src/bench.py",), repo)
    doc = json.loads(res.read_text())
    assert doc["commit"] == second and doc["date"] == "2026-11-24 05:00 UTC"
    assert doc["date_source"] == "recorded by the bench"
    assert doc["provenance"] == prov.RECOVERED
    assert doc["measured_paths"] == sorted({*prov.MEASURED_ALWAYS, "src/bench.py"})
    assert not prov.recover(res, (), repo)  # has a commit now: left as it is
    st = prov.check(doc, "docs/bench/kv/results.json", repo)
    assert st.recovered and "provenance recovered from git history" in st.cite()
    res.write_text(json.dumps({"command": "c"}))
    third = commit_all(repo, "no date")
    assert prov.recover(res, (), repo)
    doc = json.loads(res.read_text())
    assert doc["commit"] == third and doc["date_source"] == "the commit's date"
    assert doc["date"] == git(repo, "log", "-1", "--format=%cI", third)


def test_bench_of_maps_a_results_path_to_its_bench() -> None:
    assert prov.bench_of("kv/results.json") == "kv"
    assert prov.bench_of("local-tp2/results.json") == "local"
    assert prov.bench_of("criu/bench-density.json") == "density"
    assert prov.bench_of("criu/bench.json") == "criu"
    assert prov.bench_of("cluster/demo/bench.json") == "cluster"
    assert prov.bench_of("cluster-up.json") == "cluster-up"
    assert prov.bench_of("report/naive_boot.json") == "naive"
    assert prov.bench_of("elsewhere/x.json") == ""


def test_provenance_line_for_a_bench_table() -> None:
    doc = {
        "commit": "abcdef1234567890",
        "dirty": True,
        "date": "2026-11-25T10:00:00Z",
        "host": {"load_avg_at_start": [1.0, 2, 3], "load_avg_at_end": [2.5, 2, 3], "disk": "vda"},
    }
    assert prov.provenance_line(doc) == (
        "Made from commit abcdef1234 (with uncommitted changes to the measured code), "
        "2026-11-25T10:00:00Z, load average 1.0 at the start, 2.5 at the end, disk vda."
    )
    assert prov.provenance_line({}) == "Made from commit not recorded."
