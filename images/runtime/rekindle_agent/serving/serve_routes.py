"""Which requests the serve port forwards to vLLM: an allowlist, matched on the raw path.

vLLM runs with its development endpoints on (/collective_rpc, /sleep,
/wake_up, /reset_prefix_cache ...), which the agent needs, and it serves
LoRA loading, profiling and RL weight updates next to the OpenAI API. The
serve port is reachable by anyone who reaches the pod, so it forwards only
rekindle_contract.api.SERVE_ROUTES; everything else is answered 404 by the
agent and never reaches vLLM.

The match is on the path exactly as it came on the wire, before any
decoding: a percent-encoded byte, an empty, `.` or `..` segment, or a
trailing slash never matches, so what is checked is what vLLM routes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from rekindle_contract.api import SERVE_ROUTES

# One path segment standing for an id: plain characters, not starting with a dot.
_ID = r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,255}"


def _compile(routes: Iterable[tuple[str, str]]) -> list[tuple[str, re.Pattern[str]]]:
    out = []
    for method, path in routes:
        parts = [_ID if part == "{id}" else re.escape(part) for part in path.split("/")]
        out.append((method, re.compile("/".join(parts))))
    return out


_ROUTES = _compile(SERVE_ROUTES)


def allowed(method: str, raw_path: str) -> bool:
    """Whether the serve port forwards method raw_path (the path without its query)."""
    return any(m == method and rx.fullmatch(raw_path) for m, rx in _ROUTES)


def known_path(raw_path: str) -> bool:
    """The path is a forwarded route for some method (405 rather than 404 for another one)."""
    return any(rx.fullmatch(raw_path) for _m, rx in _ROUTES)
