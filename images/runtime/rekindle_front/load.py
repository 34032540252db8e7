"""The replicas' queues (each agent's GET /get_load) to what KEDA scales on."""

from __future__ import annotations

from dataclasses import dataclass

from rekindle_agent.serving.vllm_queue import Queue
from rekindle_agent.serving.vllm_queue import queue_from_json as parse_load

__all__ = ["Queue", "ServiceLoad", "parse_load", "total"]


@dataclass(frozen=True)
class ServiceLoad:
    """What /load answers: the queue over every Ready replica, plus the front's held.

    forwarded (requests the front has in flight to the replicas) is a floor for
    running + waiting: a replica too busy to answer /get_load in time still counts
    what the front sent it, so a loaded service never reads as idle to KEDA.
    """

    running: float
    waiting: float
    held: int
    forwarded: int
    replicas: int
    unread: int = 0  # Ready replicas whose /get_load could not be read

    def as_json(self) -> dict[str, float | int]:
        active = max(self.running + self.waiting, float(self.forwarded))
        return {
            # requests: everything asking for a replica's time (the default metric).
            "requests": active + self.held,
            # waiting: only what no replica has started (held ones included).
            "waiting": self.waiting + self.held,
            "running": self.running,
            "held": self.held,
            "forwarded": self.forwarded,
            "replicas": self.replicas,
            "unread": self.unread,
        }


def total(queues: list[Queue | None], held: int, forwarded: int = 0) -> ServiceLoad:
    """queues: one per Ready replica, None where its /get_load could not be read."""
    read = [q for q in queues if q is not None]
    return ServiceLoad(
        running=sum(q.running for q in read),
        waiting=sum(q.waiting for q in read),
        held=held,
        forwarded=forwarded,
        replicas=len(queues),
        unread=len(queues) - len(read),
    )
