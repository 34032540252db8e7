"""Checkpoint storage meets scheduling: when a ReadWriteOnce claim cannot serve where the
replicas run.

A ReadWriteOnce PVC is attached to one node at a time: a replica scheduled on
a second node waits in ContainerCreating (Multi-Attach). The operator cannot
stop the scheduler from doing that, so it says so in a Warning Event. (Where
node-local checkpoints, hostPath or the node agent's, pull new replicas:
placement.py.)
"""

from __future__ import annotations

from collections.abc import Iterable

from rekindle_operator.spec import IsvcSpec


def rwo_spread_warning(
    spec: IsvcSpec, claim: str, access_modes: Iterable[str], nodes: Iterable[str]
) -> str | None:
    """The Warning's message when a ReadWriteOnce checkpoint claim meets pods on several nodes."""
    spread = sorted({n for n in nodes if n})
    if not spec.storage.uses_claim() or len(spread) < 2 or "ReadWriteMany" in access_modes:
        return None
    return (
        f"checkpoint PVC {claim} is ReadWriteOnce but replicas run on nodes "
        f"{', '.join(spread)}: only pods on the node that mounts it can start (Multi-Attach). "
        "Set spec.coldStart.storage.pvc.accessMode: ReadWriteMany with a storage class "
        "that offers it (or an existingClaim that is ReadWriteMany), or use hostPath storage"
    )
