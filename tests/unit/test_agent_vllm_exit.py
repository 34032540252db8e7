"""How the agent words a vLLM that died while serving (its Failed message).

A SIGBUS is how an undersized /dev/shm shows (vLLM's multimodal ring buffer
is sparse: the first write past the tmpfs limit kills the writer), so the
message names the signal and that likely cause; tests/vllm/test_mm_cache.py
makes it happen for real.
"""

from __future__ import annotations

import signal
from typing import Any, cast

from rekindle_agent.supervision.vllm_process import VllmProcess, describe_exit


class FakeReaper:
    def __init__(self, statuses: dict[int, int]) -> None:
        self.statuses = statuses

    def wait(self, pid: int, timeout: float | None = None) -> int:
        if pid not in self.statuses:
            raise TimeoutError(f"pid {pid} still running after {timeout}s")
        return self.statuses[pid]


def vllm_with(statuses: dict[int, int], root: int | None) -> VllmProcess:
    proc = VllmProcess(["true"], {}, "/nonexistent/vllm.log", cast(Any, FakeReaper(statuses)))
    proc.root_pid = root
    return proc


def test_sigbus_names_dev_shm() -> None:
    text = describe_exit(-signal.SIGBUS)
    assert text.startswith(" (killed by SIGBUS: ")
    assert "/dev/shm" in text


def test_other_endings() -> None:
    assert describe_exit(None) == ""
    assert describe_exit(0) == " (exit code 0)"
    assert describe_exit(3) == " (exit code 3)"
    assert describe_exit(-signal.SIGKILL) == " (killed by SIGKILL)"
    assert describe_exit(-200) == " (killed by signal 200)"


def test_exit_code_comes_from_the_reaper() -> None:
    assert vllm_with({42: -signal.SIGBUS}, 42).exit_code() == -signal.SIGBUS
    assert vllm_with({}, 42).exit_code() is None  # not reaped (yet)
    assert vllm_with({42: 0}, None).exit_code() is None  # no tree
