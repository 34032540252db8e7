"""TCP ports for the harness's agents and their vLLM, outside the kernel's ephemeral range.

vLLM's port must be a number the agent knows in advance, and a restored vLLM
listens on it again (and on the ephemeral ports its internal servers had).
Picking a free port and closing it
races every other process on the machine: the kernel hands out ports for
bind(port 0) and for outgoing connections from the ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range), so a port picked there can be
taken before vLLM binds it, or while a checkpoint waits to be restored.
A port outside that range is never handed out by the kernel; only a process
that asks for that very number can take it, and a random pick makes two
harnesses on one machine unlikely to ask for the same one.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below: well-known and registered services' usual ports


def ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = EPHEMERAL_RANGE.read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1", tries: int = 200, exclude: set[int] | None = None) -> int:
    """A port outside the ephemeral range that nothing listens on right now (nor in exclude)."""
    lo, hi = ephemeral_range()
    skip = exclude or set()
    candidates = [p for p in range(LOWEST, 65536) if not lo <= p <= hi and p not in skip]
    for port in random.sample(candidates, min(tries, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port outside the ephemeral range {lo}-{hi} on {host}")
