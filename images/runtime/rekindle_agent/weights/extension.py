"""Rekindle's vLLM worker extension (placeholder; the full RPCs are being written)."""

from __future__ import annotations


class RekindleWorkerExtension:
    """Mixed into every vLLM worker by `--worker-extension-cls`."""

    def rekindle_ping(self) -> dict[str, object]:
        return {"ok": True}
