"""Whether a vLLM worker's weight reload maps the checkpoint's weight dump or copies it.

Mapping the dump privately over the weights' memory (rekindle_weights.reload,
ReloadOptions.map_file) avoids first-touch faults on freshly allocated memory,
the limit of a copy on hosts that back guest memory lazily (docs/weights.md,
"Mapped reload"). The price: the server's weights are the file's pages for as
long as it runs, so the file must never change. This module holds the rule;
the worker extension applies it, the agent's restore passes the off switch on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from rekindle_agent.mapped_files import immutable

# "0" in the agent's (and so vLLM's) environment: reloads copy the dump, never map it.
MAP_WEIGHTS_ENV = "REKINDLE_MAP_WEIGHTS"
# PyTorch's switch for page-aligned (2 MiB, THP-advised) CPU allocations of 2 MiB and
# more: only page-aligned memory can have the dump's pages mapped over it.
THP_ENV = "THP_MEM_ALLOC_ENABLE"


def switched_off(env: Mapping[str, str] | None = None) -> bool:
    """The off switch, REKINDLE_MAP_WEIGHTS=0, is set in env (default: this process's)."""
    return (os.environ if env is None else env).get(MAP_WEIGHTS_ENV, "1").strip() == "0"


def map_choice(
    device: str, data_file: Path, asked: bool | None = None, env: Mapping[str, str] | None = None
) -> tuple[bool, str]:
    """Whether a reload maps the dump instead of copying it, and why.

    A mapped dump must stay unchanged for the server's whole life (a truncated
    file would SIGBUS it, a rewritten one would change its weights), like the
    pages images the mmap restore maps: so only a dump whose data file carries
    the immutable flag is mapped, which the agent sets on a proven checkpoint
    (immutable.protect_weights). Only CPU memory is mapped. Off switches: asked
    False (the caller: the restoring agent's own switch) or REKINDLE_MAP_WEIGHTS=0
    in env (this server's environment). Only page-aligned storages are mapped:
    PyTorch aligns allocations of 2 MiB and more with THP_MEM_ALLOC_ENABLE=1,
    which the agent sets for vLLM on CPU; the reason says when it is missing.
    """
    env = os.environ if env is None else env
    if asked is False:
        return False, "copied: map_weights=false"
    if switched_off(env):
        return False, f"copied: {MAP_WEIGHTS_ENV}=0"
    if device != "cpu":
        return False, f"copied: device {device} (only CPU memory is mapped)"
    if not immutable.is_immutable(data_file):
        return False, f"copied: {data_file.name} is not immutable (chattr +i)"
    why = "mapped where page-aligned"
    if env.get(THP_ENV) != "1":
        why += f" ({THP_ENV} is not 1 in this server: few storages are page-aligned)"
    return True, why
