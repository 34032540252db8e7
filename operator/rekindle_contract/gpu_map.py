"""Which GPU a restored CUDA process goes to: the checkpoint's GPUs onto the pod's.

Shared by the in-pod agent (which hands the map to CRIU's CUDA plugin) and the
node agent (which runs cuda-checkpoint itself): one rule for both.
"""

from __future__ import annotations

from collections.abc import Sequence


def device_map(saved: str | None, allocated: Sequence[str]) -> str:
    """The restore's GPU map for cuda-checkpoint, "old=new,...", rank by rank; "" when
    every rank keeps its GPU.

    saved: the checkpoint's GPUs (its fingerprint's gpu_uuid, in CUDA order, which is
    rank order: vLLM was pinned to them in that order); allocated: this pod's, in the
    same order. Without a map the driver puts the memory back on the dump-time GPU,
    which is another pod's on this node and does not exist on another node. Raises
    ValueError, saying what to change, when the counts differ or saved is unknown.
    """
    old = [u for u in (saved or "").split(",") if u]
    if not old:
        raise ValueError(
            "the checkpoint does not record which GPUs it was made on: checkpoint again"
        )
    if len(old) != len(allocated):
        raise ValueError(
            f"the checkpoint was made on {len(old)} GPU(s) ({','.join(old)}), this pod has "
            f"{len(allocated)} ({','.join(allocated) or 'none'}): request as many GPUs as the "
            "checkpoint's tensor parallel size"
        )
    if old == list(allocated):
        return ""
    return ",".join(f"{a}={b}" for a, b in zip(old, allocated, strict=True))
