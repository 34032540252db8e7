"""A compiled vLLM (torch.compile on, no --enforce-eager) restored in a pod that never
compiled: the kernels it maps come from the checkpoint.

vLLM's CPU worker loads what Inductor compiled (C++ kernels built into shared
objects) from its compile cache and keeps them mapped; on GPU, Triton and
FlashInfer do the same from theirs. The agent puts those caches below the run
dir (vllm_launch.cache_env) and saves every file the tree maps or holds open
there (checkpoint.run_dir_files). Here the cache is wiped before the restore, as
a new pod would have it: the restore must bring the kernels back and answer as
the compiled server did.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from rekindle_agent.process_tree import proctree

from tests.vllm.churn import vllm_tree
from tests.vllm.conftest import AgentFactory, AgentProc, completions, factory_for

pytestmark = [pytest.mark.vllm, pytest.mark.criu]


@pytest.fixture(scope="module")
def factory(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, criu_prefix: Path
) -> Iterator[AgentFactory]:
    yield from factory_for(tmp_path_factory, "agent-compiled", tiny_model, criu_prefix)


def mapped_below(agent: AgentProc, directory: Path) -> set[str]:
    """Files below directory that the agent's vLLM tree maps."""
    out: set[str] = set()
    for pid in vllm_tree(agent, int(agent.status().raw["vllm_pid"])):
        out |= {p for p in proctree.mapped_paths(pid) if p.startswith(f"{directory}/")}
    return out


def test_a_compiled_server_restores_in_a_pod_without_its_compile_cache(
    factory: AgentFactory,
) -> None:
    cache = factory.run_dir / "cache"
    ckpt = factory.checkpoints / "compiled"
    booted = factory.start(name="compiled", cpu_compile=True)
    try:
        st = booted.wait_ready(900)
        assert st.origin == "booted", st.raw
        kernels = mapped_below(booted, cache)
        # The premise: the compiled server maps kernels from its compile cache.
        assert any(k.endswith(".so") for k in kernels), kernels
        before = completions(booted)
        manifest = booted.client.checkpoint(str(ckpt), timeout=900)
    except BaseException:
        print(booted.tail(200))
        raise
    finally:
        booted.stop()
    saved = {str(r["path"]) for r in manifest["extra_files"] if r.get("exact")}
    assert kernels <= saved, kernels - saved

    shutil.rmtree(cache)  # a new pod: nothing compiled here
    restored = factory.start(
        name="compiled-restore", cpu_compile=True, restore_from=str(ckpt), restore_policy="require"
    )
    try:
        st = restored.wait_ready(600)
        assert st.origin == "restored", (st.raw, restored.tail(80))
        # It maps kernels again, each one put back from the checkpoint (the booted tree
        # may map one more: a kernel loaded at start-up and dropped before the dump).
        again = mapped_below(restored, cache)
        assert any(k.endswith(".so") for k in again) and again <= saved, again - saved
        assert completions(restored) == before
    finally:
        restored.stop()
