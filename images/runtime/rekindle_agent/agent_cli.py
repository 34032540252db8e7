"""The agent's subcommands for cli.py (`rekindle agent`, `rekindle bench local`).

Importing this must stay cheap: each subcommand imports its heavy modules
only when it runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from rekindle_agent.config import add_agent


def add_bench(sub: argparse._SubParsersAction) -> None:
    from rekindle_agent.bench_local import add_bench_local

    add_bench_local(sub)


ADDERS: list[Callable[[argparse._SubParsersAction], None]] = [add_agent, add_bench]
