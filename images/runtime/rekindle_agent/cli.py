"""`rekindle agent ...`: the in-pod agent, PID 1 of Rekindle's runtime container.

Also runs as `python -m rekindle_agent.cli agent ...` (the test harness does).
Order matters for a fast restore: the prefetch starts first, the restore flow
next, and only then the HTTP side (aiohttp takes about a second to import),
so the heavy modules are imported inside run_agent, after the early start.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
from pathlib import Path

from rekindle_agent import config
from rekindle_agent.restoring.early import EarlyStart
from rekindle_agent.serving import auth
from rekindle_agent.serving.auth import read_api_key, read_token


def run_agent(ns: argparse.Namespace) -> int:
    try:
        cfg = config.from_args(ns)
        config.check_model_dir(cfg.model)
        signing_key = auth.read_signing_key(cfg.signing_key_file) if cfg.signing_key_file else None
        api_key = read_api_key(cfg.api_key_file) if cfg.api_key_file else None
        metrics_token = read_token(cfg.metrics_token_file) if cfg.metrics_token_file else None
    except config.ConfigError as e:
        print(f"rekindle agent: {e}", file=sys.stderr)
        return 2
    refused_pointer = config.refuse_unsigned_pointer(cfg, signing_key)
    if refused_pointer:
        cfg = dataclasses.replace(cfg, restore_from=None)  # nothing reads the path
    early = EarlyStart(signing_key)
    early.begin(cfg)
    early_stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: early_stop.set())
    from rekindle_agent.agent import Agent, setup_logging

    setup_logging()
    Path(cfg.run_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        agent = Agent(
            cfg,
            read_token(cfg.token_file),
            early,
            api_key=api_key,
            signing_key=signing_key,
            metrics_token=metrics_token,
            refused_pointer=refused_pointer,
        )
    except config.ConfigError as e:
        print(f"rekindle agent: {e}", file=sys.stderr)
        return 2
    starter = threading.Thread(target=agent.start, name="start", daemon=True)
    starter.start()
    from rekindle_agent.serving.server import run

    return run(agent, starter, early_stop)


def remove_checkpoint(ns: argparse.Namespace) -> int:
    """The cleanup Job's command: the pages images are immutable, so rm -rf cannot.

    --from-store: the checkpoints are in the node agents' object store (this pod
    holds no credential for it): the node agent of this Job's node deletes them,
    for this Job's namespace only. --from-node-cache: only that node agent's cached
    copies go (unless a replica there maps them); the published copies stay.
    """
    if ns.from_store or ns.from_node_cache:
        return _ask_node_agent(ns.paths, evict=ns.from_node_cache)
    from rekindle_agent.mapped_files.immutable import remove_tree

    for path in ns.paths:
        try:
            remove_tree(Path(path))
        except OSError as e:
            print(f"rekindle remove-checkpoint: {path}: {e}", file=sys.stderr)
            return 1
        print(f"removed {path}")
    return 0


def _ask_node_agent(names: list[str], evict: bool) -> int:
    from rekindle_contract.pod import NODE_SOCKET_ENV, POD_UID_ENV

    from rekindle_agent.checkpointing.criu_backend import BackendError, NodeAgent

    flag = "--from-node-cache" if evict else "--from-store"
    sock, uid = os.environ.get(NODE_SOCKET_ENV), os.environ.get(POD_UID_ENV)
    if not sock or not uid:
        print(
            f"rekindle remove-checkpoint {flag}: {NODE_SOCKET_ENV} and {POD_UID_ENV} "
            "must be set (the node agent's socket volume and the pod's UID)",
            file=sys.stderr,
        )
        return 2
    node = NodeAgent(sock, uid)
    for name in names:
        try:
            answer = node.evict(name) if evict else node.unpublish(name)
        except BackendError as e:
            print(f"rekindle remove-checkpoint: {name}: {e}", file=sys.stderr)
            return 1
        if not evict:
            print(f"removed {name} from {answer.get('where')} ({answer.get('objects')} objects)")
        elif answer.get("held"):  # this node still holds it: say why, fail
            print(f"rekindle remove-checkpoint: {name} kept: {answer.get('why')}", file=sys.stderr)
            return 1
        else:
            print(f"{name}: {'evicted' if answer.get('evicted') else answer.get('why')}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rekindle", description="Rekindle's in-pod agent")
    sub = parser.add_subparsers(dest="cmd", required=True)
    agent = sub.add_parser(
        "agent",
        help="run the in-pod agent: boot or restore vLLM, checkpoint it",
        description="Flags override the --config file, which overrides the environment.",
    )
    config.add_arguments(agent)
    agent.set_defaults(func=run_agent)
    rm = sub.add_parser(
        "remove-checkpoint",
        help="delete checkpoint directories, immutable pages images included "
        "(needs CAP_LINUX_IMMUTABLE); never crosses into another file system",
    )
    rm.add_argument("paths", nargs="+", metavar="DIR")
    rm.add_argument(
        "--from-store",
        action="store_true",
        help="the checkpoints (named by their directory) are in the node agents' object "
        "store: ask this node's agent to delete them",
    )
    rm.add_argument(
        "--from-node-cache",
        action="store_true",
        help="drop only this node's cached copies (unless a replica here maps them); "
        "the published copies stay",
    )
    rm.set_defaults(func=remove_checkpoint)
    fetch = sub.add_parser(
        "fetch-model",
        help="download a Hugging Face model (--id) or an S3 prefix (--s3-*) into a shared "
        "cache (the pod's init container); a revision or listing already there is not "
        "downloaded again",
    )
    from rekindle_agent import model_fetch

    model_fetch.add_arguments(fetch)
    fetch.set_defaults(func=fetch_model)
    return parser


def fetch_model(ns: argparse.Namespace) -> int:
    """The hub (--id) or an S3-compatible store (--s3-endpoint): exit 0 with the model's
    path on stdout, or 1 with the reason on stderr."""
    from rekindle_store.s3 import Bucket

    from rekindle_agent import model_fetch, model_fetch_s3

    if ns.s3_endpoint is None:
        return model_fetch.run(ns)
    if not ns.s3_bucket or not ns.s3_prefix:
        model_fetch.log("--s3-endpoint needs --s3-bucket and --s3-prefix")
        return 2
    try:
        bucket = Bucket(
            ns.s3_endpoint, ns.s3_bucket, model_fetch_s3.credentials_from_env(), ns.s3_region
        )
        path = model_fetch_s3.fetch_s3(bucket, ns.s3_prefix, ns.cache)
    except (model_fetch.FetchError, ValueError, OSError) as e:
        model_fetch.log(str(e))
        return 1
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return int(ns.func(ns))


if __name__ == "__main__":
    sys.exit(main())
