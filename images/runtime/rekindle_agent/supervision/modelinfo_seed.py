"""vLLM's model-class facts, computed once per image instead of once per boot.

At start-up vLLM asks what a model class supports (text generation, multimodal,
pooling ...). To keep CUDA out of its own process it answers in a fresh Python
process that imports vLLM and the model's module again: on a small CPU node
about 12 s of every boot (27 s when the image has no byte-compiled files). It
keeps the answer in $VLLM_CACHE_ROOT/modelinfos/, keyed by a hash of the
model's module source, and reuses it when the hash still matches. A pod's
cache root is empty (it lives in the pod's run dir), so every boot pays.

The image build writes those files once (`write`, run as a script with the
image's interpreter: `python modelinfo_seed.py --out DIR ARCH...`) and the agent
copies them into the cache root before vLLM starts (`install`). vLLM checks the
hash itself: a seed from another vLLM version is ignored, never wrong. Only the
standard library is imported at module level, so the build can run this file
before the project is installed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

SEED_ENV = "REKINDLE_VLLM_MODELINFO_SEED"
DEFAULT_SEED_DIR = "/opt/rekindle/vllm-modelinfos"
CACHE_SUBDIR = "modelinfos"  # vLLM's, below VLLM_CACHE_ROOT

log = logging.getLogger("rekindle.agent")


def seed_dir(env: Mapping[str, str]) -> Path:
    return Path(env.get(SEED_ENV) or DEFAULT_SEED_DIR)


def install(env: Mapping[str, str]) -> list[str]:
    """Copy the seed's files into env's VLLM_CACHE_ROOT where vLLM has none yet; the
    names copied. A missing seed or an unwritable cache costs only the time it saves."""
    seed, root = seed_dir(env), env.get("VLLM_CACHE_ROOT")
    if not root or not seed.is_dir():
        return []
    dest = Path(root) / CACHE_SUBDIR
    copied = []
    try:
        dest.mkdir(parents=True, exist_ok=True)
        for f in sorted(seed.glob("*.json")):
            if not (dest / f.name).exists():
                shutil.copyfile(f, dest / f.name)
                copied.append(f.name)
    except OSError as e:
        log.warning("vLLM's model info cache not seeded from %s: %s", seed, e)
    return copied


def write(out: Path, architectures: list[str]) -> list[Path]:
    """vLLM's model info for each architecture, as vLLM itself caches it, into out.
    Runs vLLM's own inspection in this process (vLLM must be importable)."""
    with tempfile.TemporaryDirectory() as cache:
        os.environ["VLLM_CACHE_ROOT"] = cache
        from vllm.model_executor.models.registry import ModelRegistry

        for arch in architectures:
            if arch not in ModelRegistry.models:
                raise SystemExit(f"vLLM has no model class named {arch!r}")
            ModelRegistry.models[arch].inspect_model_cls()
        made = sorted((Path(cache) / CACHE_SUBDIR).glob("*.json"))
        if not made:
            raise SystemExit(f"vLLM wrote no model info for {architectures} under {cache}")
        out.mkdir(parents=True, exist_ok=True)
        for f in made:
            json.loads(f.read_bytes())  # whole, or the build stops here
            shutil.copyfile(f, out / f.name)
            os.chmod(out / f.name, 0o644)
        return [out / f.name for f in made]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write vLLM's model info cache for ARCHs into --out")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("architectures", nargs="+", metavar="ARCH", help="e.g. LlamaForCausalLM")
    ns = p.parse_args(argv)
    for f in write(ns.out, ns.architectures):
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
