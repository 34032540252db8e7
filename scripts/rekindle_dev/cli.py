"""`rekindle`: the developer and in-pod command line.

Each subcommand lives with the code it drives; this module only wires them up.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def _cmd_model_tiny(args: argparse.Namespace) -> int:
    from rekindle_dev.models import TinyModelSpec, generate_tiny_model

    out = generate_tiny_model(Path(args.out), TinyModelSpec(seed=args.seed))
    print(out)
    return 0


def _add_model(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="generate the embedded models")
    msub = model.add_subparsers(dest="model_cmd", required=True)
    tiny = msub.add_parser("tiny", help="a seeded random-weight Llama with its own tokenizer")
    tiny.add_argument("--out", required=True, help="directory to write the model into")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_cmd_model_tiny)


def bench_subcommands(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The `rekindle bench` group, created once; each benchmark adds itself under it."""
    bench = sub.choices.get("bench")
    if bench is None:
        bench = sub.add_parser("bench", help="benchmarks")
        bench.add_subparsers(dest="bench_cmd", required=True)
    return next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rekindle", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    from rekindle_agent import agent_cli
    from rekindle_dev.bench_weights import add_bench_weights

    adders: list[Callable[[argparse._SubParsersAction], None]] = [
        _add_model,
        *agent_cli.ADDERS,
        add_bench_weights,
    ]
    for add in adders:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
