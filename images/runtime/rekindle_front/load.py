"""vLLM's Prometheus text to the numbers an autoscaler scales on."""

from __future__ import annotations

from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"


@dataclass(frozen=True)
class Queue:
    """One replica's engine queue: requests being decoded and requests waiting."""

    running: float = 0.0
    waiting: float = 0.0


def _sample(line: str) -> tuple[str, float] | None:
    """(family, value) of one sample line `name{labels} value [timestamp]`; None otherwise."""
    if not line or line.startswith("#"):
        return None
    if "{" in line:
        name, _, rest = line.partition("{")
        rest = rest.rpartition("}")[2]
    else:
        name, _, rest = line.partition(" ")
    words = rest.split()
    if not words:
        return None
    try:
        return name.strip(), float(words[0])
    except ValueError:
        return None


def parse_queue(text: str) -> Queue:
    """Sum each family over its label sets (one per model and engine)."""
    running = waiting = 0.0
    for line in text.splitlines():
        sample = _sample(line)
        if sample is None:
            continue
        if sample[0] == RUNNING:
            running += sample[1]
        elif sample[0] == WAITING:
            waiting += sample[1]
    return Queue(running, waiting)


@dataclass(frozen=True)
class ServiceLoad:
    """What /load answers: the queue over every Ready replica, plus the front's held.

    forwarded (requests the front has in flight to the replicas) is a floor for
    running + waiting: a replica too busy to answer /metrics in time still counts
    what the front sent it, so a loaded service never reads as idle to KEDA.
    """

    running: float
    waiting: float
    held: int
    forwarded: int
    replicas: int
    unread: int = 0  # Ready replicas whose /metrics could not be read

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
    """queues: one per Ready replica, None where its /metrics could not be read."""
    read = [q for q in queues if q is not None]
    return ServiceLoad(
        running=sum(q.running for q in read),
        waiting=sum(q.waiting for q in read),
        held=held,
        forwarded=forwarded,
        replicas=len(queues),
        unread=len(queues) - len(read),
    )
