"""LoRA adapters: how they are named and where they live, as the operator writes them
and the agent reads them.

An adapter is a directory (PEFT format: adapter_config.json and the weights) inside
the model's own directory, so it comes from wherever the model comes from (the
image, a PVC, a node path, the hub, S3) with the same fetch and the same content
digest. Its name is what clients put in a request's "model" field.
"""

from __future__ import annotations

import re

# Ranks vLLM's --max-lora-rank accepts.
MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")


class LoraError(ValueError):
    """An adapter name or directory that is not allowed; the message says what to change."""


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise LoraError(
            f"LoRA adapter name {name!r}: use 1-64 characters of letters, digits, '_', "
            "'-' and '.', not starting with '.'"
        )
    return name


def check_dir(path: str) -> str:
    """A directory relative to the model's, that cannot leave it."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise LoraError(
            f"LoRA adapter directory {path!r}: give it relative to the model's directory, "
            "without '.', '..' or empty parts (e.g. adapters/sql)"
        )
    return path


def format_adapters(adapters: list[tuple[str, str]]) -> str:
    """(name, directory) pairs as the agent's --lora-adapters value: NAME=DIR,..."""
    return ",".join(f"{check_name(n)}={check_dir(d)}" for n, d in adapters)


def parse_adapters(value: str | None) -> list[tuple[str, str]]:
    """--lora-adapters NAME=DIR,... as (name, directory) pairs; names unique."""
    out: list[tuple[str, str]] = []
    for item in (value or "").split(","):
        if not item.strip():
            continue
        name, sep, path = item.strip().partition("=")
        if not sep:
            raise LoraError(f"LoRA adapter {item!r}: write NAME=DIR")
        out.append((check_name(name), check_dir(path)))
    names = [n for n, _ in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise LoraError(f"LoRA adapter names must be unique: {', '.join(dup)} repeat")
    return out
