"""`python -m rekindle_operator`: run the operator (standalone, no peering by default).

Flags: --namespace NS (repeatable; default: all namespaces), --verbose,
--liveness URL (e.g. http://0.0.0.0:8080/healthz for the Deployment's probe).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import kopf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rekindle_operator", description=__doc__)
    p.add_argument("--namespace", "-n", action="append", default=[], help="watch only these")
    p.add_argument("--verbose", "-v", action="store_true")
    p.add_argument(
        "--liveness", default=None, help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz"
    )
    args = p.parse_args(argv)
    # kopf names itself after the login user (getpass.getuser()); an arbitrary
    # non-root UID without a passwd entry, as in the chart, would crash it.
    os.environ.setdefault("USER", "rekindle-operator")
    kopf.configure(verbose=args.verbose)
    import rekindle_operator.handlers  # noqa: F401  (registers the handlers)

    asyncio.run(
        kopf.operator(
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=args.liveness,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
