"""The mapped weight reload, on by default, with a real vLLM CPU server and real CRIU.

A model whose big tensors are 2 MiB and more (conftest's wide model: PyTorch
page-aligns them under THP_MEM_ALLOC_ENABLE=1, which the agent sets): a proven
checkpoint's weight dump is immutable; a replica restored from it maps the
dump (with the lifetime mark held), answers exactly as before, checkpoints
again without it (the release unmaps first), and the first checkpoint can then
be deleted. With REKINDLE_MAP_WEIGHTS=0 a replica of the same checkpoint copies.

One boot makes the first checkpoint; both tests restore it. The mapping test
deletes it at its end, so the module's Proven makes it again if a test needs
it after that (a test run alone, or out of order, still finds it).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rekindle_agent.mapped_files import immutable
from rekindle_weights.reload import MAPPED_MARK

from tests.vllm.conftest import PROMPTS, AgentFactory, AgentProc, factory_for

pytestmark = [pytest.mark.vllm, pytest.mark.criu]

# ... mapped from PATH (WHY), 0.043s (read 0.010s, CPU GEMM repack 0.030s): WHY may hold
# parentheses itself ("not immutable (chattr +i)"), so it ends at the "), SECONDSs" after it.
RELOAD_LINE = re.compile(
    r"rekindle: reload rank 0: (\d+) bytes, (\d+) mapped from (\S+) \((.*)\), [\d.]+s"
)


@pytest.fixture(scope="module")
def factory(
    tmp_path_factory: pytest.TempPathFactory, wide_model: Path, criu_prefix: Path
) -> Iterator[AgentFactory]:
    yield from factory_for(tmp_path_factory, "agent-mapped", wide_model, criu_prefix)


def completions(agent: AgentProc) -> list[str]:
    return [agent.complete(p) for p in PROMPTS]


def reloads(agent: AgentProc, timeout: float = 60) -> list[tuple[int, int, str, str]]:
    """(bytes, mapped bytes, data file, why) of every reload in this agent's vLLM log, in
    order (the last one is the latest: a restored log may carry older lines).

    The agent echoes vLLM's lines by following its log file, so a line vLLM wrote
    before the agent said Ready can reach the agent's log a moment after: wait (at
    most timeout) until there is at least one.
    """
    deadline = time.monotonic() + timeout
    while True:
        out = []
        for line in agent.tail(100000).splitlines():
            m = RELOAD_LINE.search(line)
            if m and line.startswith("[vllm] "):
                out.append((int(m[1]), int(m[2]), m[3], m[4]))
        if out or time.monotonic() >= deadline:
            return out
        time.sleep(0.1)


def mappers(data: Path) -> list[int]:
    """Host pids with a mapping of data's inode (whatever path their namespace shows)."""
    st = os.stat(data)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x} {st.st_ino} "
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            maps = (d / "maps").read_text()
        except OSError:
            continue
        if any(want in line for line in maps.splitlines()):
            pids.append(int(d.name))
    return pids


def marks(data: Path) -> list[str]:
    """/proc/locks lines: OFD read locks on the mapped mark of data's inode."""
    ino = str(os.stat(data).st_ino)
    return [
        line
        for line in Path("/proc/locks").read_text().splitlines()
        if "OFDLCK" in line
        and " READ " in f" {line} "
        and any(f.count(":") == 2 and f.rsplit(":", 1)[1] == ino for f in line.split())
        and line.split()[-2] == str(MAPPED_MARK)
    ]


@dataclass
class Checkpoint:
    """A checkpoint made by a booted server, and what that server said."""

    path: Path
    before: list[str]
    boot_status: dict[str, Any]  # after the checkpoint: the proving restore
    boot_reload: tuple[int, int, str, str]  # the proving restore's weight reload


class Proven:
    """The module's first checkpoint: made on first use, made again once deleted."""

    def __init__(self, factory: AgentFactory) -> None:
        self.factory = factory
        self.made = 0
        self._ckpt: Checkpoint | None = None

    def get(self) -> Checkpoint:
        if self._ckpt is None or not self._ckpt.path.exists():
            self._ckpt = self._make()
        return self._ckpt

    def _make(self) -> Checkpoint:
        self.made += 1
        path = self.factory.checkpoints / f"c1-{self.made}"
        boot = self.factory.start(name="boot")
        try:
            st = boot.wait_ready(600)
            assert st.origin == "booted"
            before = completions(boot)
            boot.client.checkpoint(str(path), timeout=900)
            st = boot.wait_ready(60)
            return Checkpoint(path, before, dict(st.raw), reloads(boot)[-1])
        except BaseException:
            print(boot.tail(200))
            raise
        finally:
            boot.stop()


@pytest.fixture(scope="module")
def proven(factory: AgentFactory) -> Proven:
    return Proven(factory)


def test_off_switch_copies(
    factory: AgentFactory, proven: Proven, monkeypatch: pytest.MonkeyPatch
) -> None:
    """REKINDLE_MAP_WEIGHTS=0 in the restoring agent's environment: nothing is mapped,
    even though the tree was dumped with mapping on."""
    c1 = proven.get()
    monkeypatch.setitem(factory.env, "REKINDLE_MAP_WEIGHTS", "0")
    replica = factory.start(name="replica-off", restore_from=str(c1.path))
    try:
        st = replica.wait_ready(300)
        assert st.origin == "restored" and st.last_fallback is None, st.raw
        *_, (_, mapped, _, why) = reloads(replica)
        assert mapped == 0 and why == "copied: map_weights=false", why
        assert mappers(c1.path / "weights" / "weights-rank0.bin") == []
        assert completions(replica) == c1.before
    finally:
        replica.stop()


def test_restored_replica_maps_the_immutable_dump(factory: AgentFactory, proven: Proven) -> None:
    c1 = proven.get()
    st = c1.boot_status
    assert st["last_checkpoint"]["weights_protection"] == "immutable", st
    # The proving restore ran before the dump was protected: it copied.
    _, mapped, _, why = c1.boot_reload
    assert mapped == 0 and "not immutable" in why, why

    data = c1.path / "weights" / "weights-rank0.bin"
    weight_files = sorted((c1.path / "weights").iterdir())
    assert len(weight_files) == 2 and all(immutable.is_immutable(p) for p in weight_files)
    with pytest.raises(PermissionError):
        data.open("r+b")

    c2 = factory.checkpoints / "c2"
    replica = factory.start(name="replica", restore_from=str(c1.path))
    try:
        st = replica.wait_ready(300).raw
        assert st["origin"] == "restored" and st["last_fallback"] is None, st
        *_, (total, mapped, path, why) = reloads(replica)
        assert path == str(data) and why == "mapped where page-aligned", why
        # The wide tensors (most of the bytes) are mapped, not copied.
        assert mapped > total // 2, (mapped, total)
        assert mappers(data), "no process maps the weight dump"
        assert len(marks(data)) >= 1, "the mapped dump carries no lifetime mark"
        assert completions(replica) == c1.before

        # A checkpoint of the server that maps the dump: the release unmaps it first,
        # so the new checkpoint holds the weights itself.
        replica.client.checkpoint(str(c2), timeout=900)
        st = replica.wait_ready(60).raw
        assert st["last_checkpoint"]["ok"], st
        assert mappers(data) == [] and marks(data) == []
        assert completions(replica) == c1.before
    except BaseException:
        print(replica.tail(200))
        raise
    finally:
        replica.stop()

    try:
        # The first checkpoint can go (its immutable files too); the second stands alone.
        immutable.remove_tree(c1.path)
        assert not c1.path.exists()
        again = factory.start(name="from-c2", restore_from=str(c2))
        try:
            st = again.wait_ready(300).raw
            assert st["origin"] == "restored" and st["checkpoint"] == str(c2), st
            *_, (_, mapped, path, _) = reloads(again)
            assert mapped > 0 and path == str(c2 / "weights" / "weights-rank0.bin")
            assert completions(again) == c1.before
        except BaseException:
            print(again.tail(200))
            raise
        finally:
            again.stop()
    finally:
        immutable.remove_tree(c2)
