"""CRIU's own test suite (zdtm) with the patched CRIU restoring with --mmap-restore.

test/zdtm.py, from the CRIU tree that `scripts/build-criu --zdtm` builds, runs once with
stock CRIU and twice with the patched CRIU whose every restore gets --mmap-restore (a
wrapper script): every test that passes with stock must pass with the patch, but for
the documented differences, which must still differ. Host flavor (`-f h`), every test
as root (ZDTM_AS_ROOT, see criu-patches/README.md).

By default a representative subset runs (SUBSET: the memory tests and a spread of the
rest), and each of its tests must pass with stock but for a cause of this machine that
the log shows (ENV_FAILURES). REKINDLE_ZDTM=all runs every static and transition test
(10-12 minutes for the three runs). Four tests at a time (-p 4): zdtm's tests mostly
wait, so on 2 cores this is faster than 2 (zdtm runs its exclusive tests alone). The
results are printed at the end of the pytest output (conftest.py) and written to
zdtm-results.json in the test's tmp dir.
"""

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rekindle_dev.testenv import require

from . import criu_helpers

pytestmark = pytest.mark.criu

REPO = Path(__file__).resolve().parents[2]

# Memory first (what --mmap-restore changes), then a spread of the rest; OFD locks
# (file_locks06-08) since the patch marks mapped images with one. Only tests that run
# with the host flavor: zdtm skips its "manual run only" tests (grow_map, maps03, ...)
# under -T and its tests that need other flavors (shm, session00, ...) under -f h.
_SUBSET = """
static/maps00 static/maps01 static/maps02 static/maps04 static/maps05 static/maps06
static/maps09 static/maps10 static/maps11 static/maps12 static/maps_file_prot
static/mprotect00 static/mlock_setuid static/mtime_mmap static/shmemfd static/shmemfd-priv
static/cow00 static/cow01 static/vdso00 static/vdso01 static/vdso02 static/vdso-proxy
static/thp_disable static/uffd-events static/write_read00 static/write_read01
static/write_read02 static/write_read10 static/pthread00 static/pthread01
static/pthread_timers static/zombie00 static/zombie01 static/env00 static/sigaltstack
static/sigpending static/pipe00 static/socket_listen static/sockets00 static/unlink_mmap00
static/unlink_mmap01 static/unlink_mmap02 static/file_locks00 static/file_locks01
static/file_locks06 static/file_locks07 static/file_locks08 static/file_lease00
static/memfd00 static/memfd01 static/memfd02 static/memfd03 static/aio00 static/aio01
static/different_creds static/seccomp_strict static/timerfd static/inotify00
static/fanotify00 static/posix_timers static/rlimits00 static/file_shared static/pdeath_sig
static/child_subreaper static/poll static/futex static/rseq00 static/membarrier
transition/fork transition/fork2 transition/maps007 transition/maps008 transition/pid_reuse
transition/shmem transition/lazy-thp transition/epoll transition/file_read transition/stack
"""
SUBSET = _SUBSET.split()

# Fail here with stock CRIU for causes outside its memory restore, where this machine has
# the cause: the line of the run's log that shows the cause, and why
# (criu-patches/README.md). Any other failure with stock fails this test. mlock_setuid
# passes with the patched CRIU (patch 0006 reads the rlimits from /proc/PID/limits).
ENV_FAILURES = {
    "zdtm/static/mlock_setuid": (
        "Can't get rlimit 0: Operation not permitted",
        "it switches uid itself, and CRIU's prlimit() on a task of another uid needs "
        "CAP_SYS_RESOURCE, which root lacks on this machine",
    ),
    "zdtm/static/file_locks01": (
        "file_locks01.c:151: Can't fetch mountinfo",
        "zdtm reads /proc/self/mountinfo in 1024-byte lines (zdtm/lib/fs.c): a longer "
        "line (the overlay mount of a container of the local cluster) fails it at start",
    ),
}
# With REKINDLE_ZDTM=all: stock passes 335 of 481 here (136 skip for the host flavor).
MIN_STOCK_PASSES_ALL = 330

# Pass with stock, fail with --mmap-restore, for a difference criu-patches/README.md
# documents (and the agent must keep such programs off the option); per patched run.
# Each must still fail so: a difference that went away is a README to update.
KNOWN_DIFFERENCES = {
    "default": {
        "zdtm/static/uffd-events": "after the restore, expects zeroes after MADV_DONTNEED on "
        "plain anonymous memory, then grows and moves whole VMAs with mremap() (EFAULT)",
    },
    "small-runs": {
        "zdtm/static/uffd-events": "as above",
        "zdtm/static/vdso-proxy": "expects at most 2 VMAs more after the restore; every mapped "
        "run splits its VMA (with the default 128 KiB runs none of its VMAs is mapped)",
    },
}

# The option must do something. zdtm's processes are small: with the default 128 KiB
# runs, the restores of these map memory from the image (of the subset); with 2-page
# runs most restores do (52 to 56 of the subset here).
MAPPED_BY_DEFAULT = ["static/maps04", "static/uffd-events", "transition/lazy-thp"]
MIN_MAPPED_SMALL_RUNS = 45

_LINE = re.compile(r"Test (zdtm/\S+) (PASS|FAIL)(?: at (.*?))?\s*[=#]*$")
_SKIP = re.compile(r"Skipping (zdtm/\S+) \((.*)\)")


@pytest.fixture(autouse=True)
def own_restored_processes() -> Iterator[None]:
    """Not the subreaper here (conftest's fixture of that name): zdtm.py owns its tests'
    processes, and it waits for a killed one with kill(pid, 0) until ESRCH, which a
    zombie adopted by this process and never reaped would never give."""
    yield


def zdtm_tree() -> Path:
    res = subprocess.run(
        [str(REPO / "scripts" / "build-criu"), "--zdtm"],
        stdout=subprocess.PIPE,
        text=True,
        timeout=1800,
        check=False,
    )
    assert res.returncode == 0, "scripts/build-criu --zdtm failed (its progress is on stderr)"
    tree = Path(res.stdout.strip().splitlines()[-1])
    assert (tree / "test" / "zdtm.py").is_file(), tree
    return tree


def mmap_wrapper(criu: Path, where: Path, small_runs: bool) -> Path:
    """A criu that is the patched one, with --mmap-restore on every restore.

    small_runs: CRIU_FAULT=139 (FI_MMAP_RESTORE_SMALL_RUNS) maps runs of pages down
    to 2 pages instead of 128 KiB: zdtm's processes are small, and this way far more
    of their restores go through the mapping.
    """
    fault = "CRIU_FAULT=139 " if small_runs else ""
    w = where / ("criu-mmap-restore-small-runs" if small_runs else "criu-mmap-restore")
    w.write_text(f"""#!/bin/sh
if [ "$1" = restore ]; then
\t{fault}exec {criu} "$@" --mmap-restore
fi
exec {criu} "$@"
""")
    w.chmod(0o755)
    return w


def run_zdtm(tree: Path, criu: Path, tests: list[str] | None, out: Path) -> dict[str, str]:
    """Run zdtm.py; returns {test: PASS | FAIL at ... | SKIP (why)}."""
    cmd = [
        "/usr/bin/python3",
        "zdtm.py",
        "run",
        "-f",
        "h",
        "--keep-going",
        "-p",
        "4",
        "--keep-img",
        "always",
        "--criu-bin",
        str(criu),
    ]
    if tests is None:
        cmd.append("-a")
    else:
        # -T (a regexp), not --from, which stops at the first failure
        cmd += ["-T", "^zdtm/(" + "|".join(re.escape(t) for t in tests) + ")$"]
    env = dict(os.environ, ZDTM_AS_ROOT="1", PATH="/usr/bin:/usr/sbin:/bin:/sbin")
    subprocess.run(["rm", "-rf", str(tree / "test" / "dump")], check=True)
    with open(out, "w") as log:
        subprocess.run(
            cmd,
            cwd=tree / "test",
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=3000,
            check=False,
        )
    results: dict[str, str] = {}
    for line in out.read_text(errors="replace").splitlines():
        if m := _LINE.search(line):
            results[m[1]] = "PASS" if m[2] == "PASS" else f"FAIL at {m[3] or '?'}"
        elif m := _SKIP.search(line):
            results[m[1]] = f"SKIP ({m[2]})"
    return results


def mapped_tests(tree: Path) -> list[str]:
    """Tests whose restore mapped memory from the image (the patch took effect)."""
    hits = []
    for log in (tree / "test" / "dump").glob("zdtm/*/*/*/*/restore.log"):
        if "mmap-restore: mapping" in log.read_text(errors="replace"):
            hits.append("/".join(log.parts[-5:-3]))
    return sorted(set(hits))


def count(results: dict[str, str], names: list[str]) -> dict[str, int]:
    return {
        k: sum(1 for t in names if results.get(t, "").startswith(k))
        for k in ("PASS", "FAIL", "SKIP")
    }


def env_failures(results: dict[str, str], log: Path) -> dict[str, str]:
    """The failures of a run that ENV_FAILURES explains, its log showing the cause."""
    text = log.read_text(errors="replace")
    return {
        t: ENV_FAILURES[t][1]
        for t, r in results.items()
        if r.startswith("FAIL") and t in ENV_FAILURES and ENV_FAILURES[t][0] in text
    }


def test_zdtm(criu_prefix: Path, tmp_path: Path, pytestconfig: pytest.Config) -> None:
    require("python3")
    tree = zdtm_tree()
    full = os.environ.get("REKINDLE_ZDTM") == "all"
    tests = None if full else SUBSET
    patched_criu = criu_prefix / "patched" / "criu"

    logs = {"stock": tmp_path / "stock.log"}
    stock = run_zdtm(tree, criu_prefix / "stock" / "criu", tests, logs["stock"])
    runs: dict[str, dict[str, str]] = {}
    mapped: dict[str, list[str]] = {}
    for mode in ("default", "small-runs"):
        wrapper = mmap_wrapper(patched_criu, tmp_path, mode == "small-runs")
        logs[mode] = tmp_path / f"patched-{mode}.log"
        runs[mode] = run_zdtm(tree, wrapper, tests, logs[mode])
        mapped[mode] = mapped_tests(tree)
    # The images zdtm kept (for mapped_tests) take hundreds of MB; its logs stay.
    subprocess.run(["rm", "-rf", str(tree / "test" / "dump")], check=True)

    names = sorted(set(stock).union(*runs.values()))
    env = {m: env_failures(r, logs[m]) for m, r in [("stock", stock), *runs.items()]}
    summary: dict[str, Any] = {
        "set": "all" if full else f"subset of {len(SUBSET)}",
        "stock": count(stock, names),
        "env_failures": env,
        "fail_both": {
            t: [stock[t]] + [runs[m].get(t) for m in runs]
            for t in names
            if stock.get(t, "").startswith("FAIL")
        },
        "runs": {},
    }
    regressions: dict[str, list[str]] = {}
    stale: dict[str, list[str]] = {}
    for mode, res in runs.items():
        differ = [t for t in names if stock.get(t) == "PASS" and res.get(t) != "PASS"]
        regressions[mode] = [
            t for t in differ if t not in KNOWN_DIFFERENCES[mode] and t not in env[mode]
        ]
        stale[mode] = [t for t in KNOWN_DIFFERENCES[mode] if not res.get(t, "").startswith("FAIL")]
        summary["runs"][mode] = {
            "counts": count(res, names),
            "mapped_by_patch": len(mapped[mode]),
            "mapped": mapped[mode],
            "regressions": regressions[mode],
            "known_differences": {
                t: KNOWN_DIFFERENCES[mode][t] for t in differ if t in KNOWN_DIFFERENCES[mode]
            },
            "only_patched_passes": [
                t for t in names if res.get(t) == "PASS" and stock.get(t) != "PASS"
            ],
        }
    summary["results"] = {t: [stock.get(t)] + [runs[m].get(t) for m in runs] for t in names}
    (tmp_path / "zdtm-results.json").write_text(json.dumps(summary, indent=1))
    pytestconfig.stash.setdefault(criu_helpers.ZDTM_SUMMARY, []).append(summary)

    where = f"(logs in {tmp_path})"
    if full:
        assert summary["stock"]["PASS"] >= MIN_STOCK_PASSES_ALL, (summary["stock"], where)
    else:
        # Every test of the subset ran in every run; with stock, each passed but for a
        # cause of this machine that its log shows.
        for run, res in [("stock", stock), *runs.items()]:
            unrun = {
                t: res.get(f"zdtm/{t}")
                for t in SUBSET
                if not res.get(f"zdtm/{t}", "SKIP").startswith(("PASS", "FAIL"))
            }
            assert not unrun, f"{run}: did not run: {unrun} {where}"
        unexplained = {
            t: r for t, r in stock.items() if r.startswith("FAIL") and t not in env["stock"]
        }
        assert not unexplained, f"fail with stock CRIU: {unexplained} {where}"
    assert not any(regressions.values()), (
        f"pass with stock, not with --mmap-restore: {regressions} {where}"
    )
    assert not any(stale.values()), (
        f"documented differences that pass with --mmap-restore now: {stale}; update "
        f"KNOWN_DIFFERENCES and criu-patches/README.md {where}"
    )
    assert set(MAPPED_BY_DEFAULT) <= set(mapped["default"]), (mapped["default"], where)
    if not full:
        assert len(mapped["small-runs"]) >= MIN_MAPPED_SMALL_RUNS, (mapped["small-runs"], where)
