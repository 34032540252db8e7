"""`python -m rekindle_operator`: run the operator (standalone, no peering by default).

Flags: --namespace NS (repeatable; default: all namespaces), --verbose,
--liveness URL (e.g. http://0.0.0.0:8080/healthz for the Deployment's probe).

`--release-finalizers DEPLOYMENT` (the chart's pre-delete hook): scale the
operator's Deployment DEPLOYMENT in this pod's namespace to 0, wait for its
pods, and remove the operator's finalizer from every InferenceService and
Checkpoint in the watched namespaces, so nothing hangs once it is uninstalled
(rekindle_operator.release).
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
    p.add_argument(
        "--release-finalizers",
        metavar="DEPLOYMENT",
        default=None,
        help="stop the operator's Deployment and remove its finalizers (uninstall hook)",
    )
    p.add_argument(
        "--operator-selector",
        default="app.kubernetes.io/component=operator",
        help="label selector of the operator's pods (with --release-finalizers)",
    )
    args = p.parse_args(argv)
    if args.release_finalizers:
        from rekindle_operator.kube import Kube
        from rekindle_operator.release import release_finalizers, stop_operator

        kube = Kube()
        own_ns = os.environ.get("REKINDLE_OPERATOR_NAMESPACE", "default")
        stop_operator(kube, own_ns, args.release_finalizers, args.operator_selector)
        n = release_finalizers(kube, args.namespace)
        print(f"released {n} object(s); checkpoint data is left in place")
        return 0
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
