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
    """What /load answers: the queue over every Ready replica, plus the front's held."""

    running: float
    waiting: float
    held: int
    replicas: int

    def as_json(self) -> dict[str, float | int]:
        return {
            # requests: everything asking for a replica's time (the default metric).
            "requests": self.running + self.waiting + self.held,
            # waiting: only what no replica has started (held ones included).
            "waiting": self.waiting + self.held,
            "running": self.running,
            "held": self.held,
            "replicas": self.replicas,
        }


def total(queues: list[Queue], held: int) -> ServiceLoad:
    return ServiceLoad(
        running=sum(q.running for q in queues),
        waiting=sum(q.waiting for q in queues),
        held=held,
        replicas=len(queues),
    )
