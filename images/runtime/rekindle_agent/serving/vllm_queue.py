"""vLLM's engine queue read from its Prometheus text: requests running and waiting.

One reading for everything that answers "how loaded is this replica": the serve
port's GET /get_load (what load-aware routers poll, server.py), which the front
reads back (queue_from_json) for its /load, which KEDA scales on (rekindle_front).
Both must agree on what counts.
"""

from __future__ import annotations

from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"


@dataclass(frozen=True)
class Queue:
    """One replica's engine queue: requests being decoded and requests waiting."""

    running: float = 0.0
    waiting: float = 0.0

    @property
    def load(self) -> int:
        """Everything asking for the engine's time, as one whole number."""
        return round(self.running + self.waiting)

    def as_json(self) -> dict[str, float | int]:
        """The body of GET /get_load: "load" is the field the vLLM router reads."""
        return {"load": self.load, "running": self.running, "waiting": self.waiting}


def at_least(queue: Queue, forwarded: int) -> Queue:
    """queue, its running count raised to the requests known to be in vLLM's hands
    (those the agent or the front relays): a metrics read that failed or lags never
    makes a busy replica look idle."""
    if forwarded <= queue.running + queue.waiting:
        return queue
    return Queue(running=float(forwarded) - queue.waiting, waiting=queue.waiting)


def queue_from_json(doc: object) -> Queue:
    """A GET /get_load body back into a Queue; ValueError if it is not one."""
    if not isinstance(doc, dict):
        raise ValueError(f"not a /get_load answer: {doc!r:.80}")
    try:
        running, waiting = float(doc["running"]), float(doc["waiting"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a /get_load answer: {doc!r:.80}") from e
    if min(running, waiting) < 0:
        raise ValueError(f"negative queue in /get_load answer: {doc!r:.80}")
    return Queue(running, waiting)


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
