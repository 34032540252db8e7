"""`python -m rekindle_front`: the front's entry point (the chart's front Deployment)."""

from __future__ import annotations

import argparse
import logging

from aiohttp import web

from rekindle_front.kube import KubeReader
from rekindle_front.server import Front, FrontConfig, app


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, FrontConfig]:
    p = argparse.ArgumentParser(prog="rekindle-front", description=__doc__)
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--host", default="0.0.0.0")
    d = FrontConfig()
    p.add_argument(
        "--hold-timeout",
        type=float,
        default=d.hold_timeout_s,
        help="seconds a request waits for a Ready replica before 503 (default %(default)s)",
    )
    p.add_argument(
        "--poll",
        type=float,
        default=d.poll_s,
        help="seconds between looks at a held service's replicas (default %(default)s)",
    )
    p.add_argument(
        "--max-held",
        type=int,
        default=d.max_held,
        help="requests held per service at most; more get 503 (default %(default)s)",
    )
    p.add_argument("--max-body-mb", type=int, default=d.max_body_mb)
    p.add_argument(
        "--upstream-timeout",
        type=float,
        default=d.upstream_timeout_s,
        help="seconds a replica may send nothing before 504 (default %(default)s)",
    )
    a = p.parse_args(argv)
    for flag in ("hold_timeout", "poll", "upstream_timeout"):
        if getattr(a, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be above 0")
    if a.max_held < 1 or a.max_body_mb < 1:
        p.error("--max-held and --max-body-mb must be at least 1")
    cfg = FrontConfig(
        hold_timeout_s=a.hold_timeout,
        poll_s=a.poll,
        max_held=a.max_held,
        max_body_mb=a.max_body_mb,
        upstream_timeout_s=a.upstream_timeout,
    )
    return a, cfg


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args, cfg = parse(argv)
    web.run_app(
        app(Front(KubeReader.in_cluster(), cfg)), host=args.host, port=args.port, access_log=None
    )
