"""vLLM's log file passed on to the agent's stdout, each line tagged (LogFollower)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rekindle_agent.supervision.vllm_process import LogFollower


@pytest.fixture()
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    yield r, w
    os.close(r)
    os.close(w)


def read_until(fd: int, needle: bytes, timeout: float = 60) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while needle not in out and time.monotonic() < deadline:
        try:
            out += os.read(fd, 65536)
        except BlockingIOError:
            time.sleep(0.02)
    return out


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def test_new_lines_tagged_old_ones_not_repeated(tmp_path: Path, pipe: tuple[int, int]) -> None:
    r, w = pipe
    log = tmp_path / "vllm.log"
    log.write_bytes(b"from an earlier boot\n")
    follower = LogFollower(str(log), w, poll_s=0.01)
    follower.follow_from_end()
    append(log, b"INFO Starting vLLM API server\nLoading 50%\rLoading 100%\n")
    out = read_until(r, b"Loading 100%")
    follower.stop()
    assert out == b"[vllm] INFO Starting vLLM API server\n[vllm] Loading 100%\n"


def test_a_restored_log_is_followed_from_its_end(tmp_path: Path, pipe: tuple[int, int]) -> None:
    """The restore recreates the file (the checkpointed pod's lines) before the tree runs."""
    r, w = pipe
    log = tmp_path / "vllm.log"
    follower = LogFollower(str(log), w, poll_s=0.01)
    follower.follow_from_end()  # the file does not exist yet
    append(log, b"booted line\n")
    assert b"[vllm] booted line\n" in read_until(r, b"booted line")
    log.unlink()
    log.write_bytes(b"checkpointed pod line\n")
    follower.follow_from_end()  # adopt(): the tree is still stopped
    append(log, b"restored tree line\npartial")
    out = read_until(r, b"restored tree line")
    follower.stop()  # what is left, a partial line too, is passed on
    out += read_until(r, b"partial")
    assert b"checkpointed pod line" not in out
    assert out == b"[vllm] restored tree line\n[vllm] partial\n"
