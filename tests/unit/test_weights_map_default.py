"""The mapped weight reload by default: its lifetime mark, the rule that picks it, the
immutable weight dump it needs, the off switch, and vLLM's environment for it."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from typing import Any

import pytest
from rekindle_dev.testenv import require

require("torch")  # the reloader is tested on real tensors: fail, never skip
import torch  # noqa: E402
from rekindle_agent.checkpointing import fingerprint  # noqa: E402
from rekindle_agent.mapped_files import immutable, mmap_policy, weights_map  # noqa: E402
from rekindle_agent.supervision.vllm_control import VllmCallError, VllmControl  # noqa: E402
from rekindle_agent.supervision.vllm_launch import vllm_env  # noqa: E402
from rekindle_weights import format as fmt  # noqa: E402
from rekindle_weights import reload as reload_mod  # noqa: E402
from rekindle_weights.dump import dump_tensors  # noqa: E402
from rekindle_weights.reload import (  # noqa: E402
    MAPPED_MARK,
    ReloadOptions,
    reload_tensors,
    unmap_ranges,
)


def _aligned(n: int, keep: list[mmap.mmap]) -> torch.Tensor:
    """n float32s on page-aligned memory (as PyTorch allocates big tensors with
    THP_MEM_ALLOC_ENABLE=1), filled with ones."""
    m = mmap.mmap(-1, n * 4)
    keep.append(m)
    t = torch.frombuffer(m, dtype=torch.float32, count=n)
    t.fill_(1.0)
    return t


@pytest.fixture()
def dump(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    src = {"w": torch.randn(8 * 4096, generator=g), "b": torch.randn(100, generator=g)}
    dump_tensors([(n, "param", t) for n, t in src.items()], tmp_path, rank=0)
    return tmp_path, src


def _marks(path: Path) -> list[str]:
    """/proc/locks lines holding the mapped mark on path's inode."""
    ino = os.stat(path).st_ino
    out = []
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        # "1: OFDLCK ADVISORY READ -1 fd:00:1234 1129466197 1129466197"
        where = [f for f in fields if f.count(":") == 2]
        if (
            "OFDLCK" in fields
            and "READ" in fields
            and where
            and int(where[0].rsplit(":", 1)[1]) == ino
            and fields[-2] == str(MAPPED_MARK)
        ):
            out.append(line)
    return out


def test_the_mark_is_the_patched_criu_s_mark() -> None:
    """One meaning for both: the dump side of the patched CRIU recognises it."""
    assert MAPPED_MARK == mmap_policy.MARK_OFFSET


def test_a_mapped_reload_marks_the_dump_until_the_last_range_is_unmapped(
    dump: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    d, src = dump
    data = fmt.data_path(d, 0)
    assert mmap_policy.ofd_locks_work(data), f"the file system of {data} has no OFD locks"
    keep: list[mmap.mmap] = []
    dst = {n: _aligned(t.numel(), keep) for n, t in src.items()}
    res = reload_tensors(d, dst, options=ReloadOptions(map_file=True))
    assert res.mapped_bytes > 0 and res.map_note == ""
    assert torch.equal(dst["w"], src["w"]) and torch.equal(dst["b"], src["b"])
    # The reload closed its fd: the mappings alone keep the open file, and so the mark.
    assert len(_marks(data)) == 1
    first, *rest = res.mapped
    unmap_ranges([first])
    assert len(_marks(data)) == (1 if rest else 0)
    unmap_ranges(rest)
    assert _marks(data) == []


def test_a_copying_reload_leaves_no_mark(dump: tuple[Path, dict[str, torch.Tensor]]) -> None:
    d, src = dump
    keep: list[mmap.mmap] = []
    dst = {n: _aligned(t.numel(), keep) for n, t in src.items()}
    res = reload_tensors(d, dst)
    assert res.mapped == () and torch.equal(dst["w"], src["w"])
    assert _marks(fmt.data_path(d, 0)) == []


def test_no_mark_means_no_mapping(
    dump: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system without OFD locks: the reload reads everything and says why."""

    def no_locks(*args: Any) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(reload_mod.fcntl, "fcntl", no_locks)
    d, src = dump
    keep: list[mmap.mmap] = []
    dst = {n: _aligned(t.numel(), keep) for n, t in src.items()}
    res = reload_tensors(d, dst, options=ReloadOptions(map_file=True))
    assert res.mapped == ()
    assert "OFD read lock" in res.map_note and "No locks available" in res.map_note
    assert torch.equal(dst["w"], src["w"]) and torch.equal(dst["b"], src["b"])
    assert res.to_json()["map_note"] == res.map_note


@pytest.fixture()
def weights_dir(tmp_path: Path) -> Path:
    d = tmp_path / "weights"
    d.mkdir()
    dump_tensors([("w", "param", torch.ones(1024))], d, rank=0)
    return d


def test_map_choice(weights_dir: Path, require_root: None) -> None:
    data = fmt.data_path(weights_dir, 0)
    on = {"THP_MEM_ALLOC_ENABLE": "1"}
    assert weights_map.map_choice("cpu", data, env=on) == (
        False,
        "copied: weights-rank0.bin is not immutable (chattr +i)",
    )
    assert immutable.protect_weights(weights_dir) == []
    try:
        assert weights_map.map_choice("cpu", data, env=on) == (True, "mapped where page-aligned")
        use, why = weights_map.map_choice("cpu", data, env={})
        assert use and "THP_MEM_ALLOC_ENABLE is not 1" in why
        assert weights_map.map_choice("cpu", data, asked=True, env=on)[0]
        off = weights_map.map_choice("cpu", data, env={**on, "REKINDLE_MAP_WEIGHTS": "0"})
        assert off == (False, "copied: REKINDLE_MAP_WEIGHTS=0")
        assert weights_map.map_choice("cpu", data, asked=False, env=on) == (
            False,
            "copied: map_weights=false",
        )
        assert weights_map.map_choice("cuda", data, env=on)[1].startswith("copied: device cuda")
        # A symlink to the immutable file is not the file: never followed, never mapped.
        link = weights_dir / "link.bin"
        link.symlink_to(data)
        assert not weights_map.map_choice("cpu", link, env=on)[0]
    finally:
        for p in weights_dir.iterdir():
            if p.is_file() and not p.is_symlink():
                immutable.set_immutable(p, False)


def test_protected_weights_resist_writers_and_remove_tree_removes_them(
    weights_dir: Path, require_root: None
) -> None:
    assert immutable.protect_weights(weights_dir) == []
    files = sorted(weights_dir.iterdir())
    assert [p.name for p in files] == ["weights-rank0.bin", "weights-rank0.json"]
    assert all(immutable.is_immutable(p) for p in files)
    for p in files:
        with pytest.raises(PermissionError):
            p.open("r+b")
        with pytest.raises(PermissionError):
            p.unlink()
    immutable.remove_tree(weights_dir.parent)
    assert not weights_dir.parent.exists()


def test_switched_off() -> None:
    assert not weights_map.switched_off({})
    assert not weights_map.switched_off({"REKINDLE_MAP_WEIGHTS": "1"})
    assert weights_map.switched_off({"REKINDLE_MAP_WEIGHTS": "0"})


def test_the_restore_passes_the_off_switch_only_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree dumped before map_weights existed is never sent the argument by default."""
    sent: list[tuple[str, object]] = []
    c = VllmControl("http://127.0.0.1:9", "cpu")
    monkeypatch.setattr(c, "_post", lambda path, body=None: sent.append((path, body)))
    c.wake("/ck/weights")
    c.wake("/ck/weights", verify=False, map_weights=False)
    reloads = [b for p, b in sent if p == "/collective_rpc"]
    assert reloads == [
        {"method": "rekindle_reload_weights", "args": ["/ck/weights"]},
        {
            "method": "rekindle_reload_weights",
            "args": ["/ck/weights"],
            "kwargs": {"verify": False, "map_weights": False},
        },
    ]


def test_vllm_env_aligns_big_cpu_allocations_and_keeps_the_fingerprint() -> None:
    cpu = vllm_env("cpu", base={})
    assert cpu["THP_MEM_ALLOC_ENABLE"] == "1"
    assert vllm_env("cpu", base={"THP_MEM_ALLOC_ENABLE": "0"})["THP_MEM_ALLOC_ENABLE"] == "0"
    assert "THP_MEM_ALLOC_ENABLE" not in vllm_env("cuda", base={})
    # Not fingerprinted: checkpoints of servers started before it still restore.
    without = {k: v for k, v in cpu.items() if k != "THP_MEM_ALLOC_ENABLE"}
    assert fingerprint.env_digest(cpu) == fingerprint.env_digest(without)


def test_a_tree_that_predates_the_switch_is_asked_again_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its extension never maps by default; it refuses the unknown argument up front."""
    sent: list[object] = []

    def post(path: str, body: Any = None) -> None:
        sent.append(body)
        if path == "/collective_rpc" and "map_weights" in body.get("kwargs", {}):
            raise VllmCallError(
                path,
                500,
                "TypeError: rekindle_reload_weights() got an unexpected keyword argument "
                "'map_weights'",
            )

    c = VllmControl("http://127.0.0.1:9", "cpu")
    monkeypatch.setattr(c, "_post", post)
    c.wake("/ck/weights", map_weights=False)
    assert sent[:2] == [
        {
            "method": "rekindle_reload_weights",
            "args": ["/ck/weights"],
            "kwargs": {"map_weights": False},
        },
        {"method": "rekindle_reload_weights", "args": ["/ck/weights"]},
    ]

    # Any other failure is the caller's to see.
    def fails(path: str, body: Any = None) -> None:
        raise VllmCallError(path, 500, "tensor 'x': checksum mismatch")

    monkeypatch.setattr(c, "_post", fails)
    with pytest.raises(VllmCallError, match="checksum"):
        c.wake("/ck/weights", map_weights=False)
