"""A vLLM server restored with --mmap-restore under allocation churn, against a booted one.

With `--mmap-restore` the restored processes' private memory is the pages
images mapped MAP_PRIVATE: pages fault in from the page cache, a write copies
the page. This module makes the restored server allocate, free and reuse
memory for a while after the restore, and checks that it computes exactly what
a booted server computes and that its memory stays comparable:

- one boot; the workload (tests/vllm/churn.py) on it gives the reference
  outputs; the memory of its vLLM tree is measured; then its checkpoint (the
  session's tiny boot and checkpoint: conftest's tiny_ckpt);
- a fresh agent, in a new PID + mount namespace, restores it with
  `--mmap-restore on`; the same workload gives the same outputs, request by
  request (greedy, temperature 0, max_tokens fixed, EOS ignored);
- after the workload the restored tree (every process of it) is alive, the
  status says restored_with_mmap, parts of its memory are still mapped from
  pages-*.img, its PSS is not above the booted tree's, and its anonymous memory
  stays well below the images' size (the untouched images stay page cache).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from rekindle_agent.process_tree import proctree

from tests.vllm import churn
from tests.vllm.conftest import AgentFactory, TinyCheckpoint

pytestmark = [pytest.mark.vllm, pytest.mark.criu]


@dataclass
class Churn:
    booted: dict[str, churn.Out]
    booted_mem: churn.Memory
    images_kib: int  # the checkpoint's pages-*.img, all processes
    restored: dict[str, churn.Out] = field(default_factory=dict)
    restored_mem: churn.Memory | None = None
    tree_before: list[int] = field(default_factory=list)  # restored tree, right after restore
    alive_after: dict[int, bool] = field(default_factory=dict)
    status_after: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


@pytest.fixture(scope="module")
def churn_run(agent_factory: AgentFactory, tiny_ckpt: TinyCheckpoint) -> Iterator[Churn]:
    """The session's checkpoint (its boot ran the workload) restored with --mmap-restore on,
    then the same workload on the restored server."""
    assert tiny_ckpt.churn_memory is not None
    c = Churn(tiny_ckpt.churn_outputs, tiny_ckpt.churn_memory, tiny_ckpt.images_kib)
    t = time.monotonic()
    agent = agent_factory.start(
        name="churn-mmap", restore_from=str(tiny_ckpt.path), mmap_restore="on"
    )
    try:
        st = agent.wait_ready(300)
        c.seconds["restore"] = time.monotonic() - t
        assert st.origin == "restored" and st.last_fallback is None, (st.raw, agent.tail(100))
        vllm_pid = st.raw["vllm_pid"]
        c.tree_before = churn.vllm_tree(agent, vllm_pid)
        t = time.monotonic()
        c.restored = churn.run_workload(agent)
        c.seconds["workload_restored"] = time.monotonic() - t
        c.alive_after = {pid: proctree.alive(pid) for pid in c.tree_before}
        c.status_after = dict(agent.status().raw)
        c.restored_mem = churn.measure(churn.vllm_tree(agent, vllm_pid))
    except BaseException:
        print(agent.tail(200))
        raise
    finally:
        agent.stop()
    print(f"churn timings (s): { {k: round(v, 1) for k, v in c.seconds.items()} }")
    print(f"booted:   {c.booted_mem.summary()}")
    print(f"restored: {c.restored_mem.summary()}")
    print(f"pages images: {c.images_kib / 1024:.0f} MiB")
    tokens = sorted(o.prompt_tokens for o in c.booted.values())
    print(f"{len(tokens)} requests, prompt tokens {tokens[0]}..{tokens[-1]}")
    yield c


def test_workload_reaches_several_blocks_and_batches() -> None:
    """The workload itself: what it claims to exercise (checked on the real token counts below)."""
    sizes = [len(r) for r in churn.WORKLOAD]
    assert sizes[0] == 1 and {2, 4, 8} <= set(sizes)
    assert any(r.stream for rnd in churn.WORKLOAD for r in rnd)
    assert any(not r.stream for rnd in churn.WORKLOAD for r in rnd)
    keys = [r.key for rnd in churn.WORKLOAD for r in rnd]
    assert len(keys) == len(set(keys))


def test_restored_outputs_match_booted(churn_run: Churn) -> None:
    assert churn_run.booted.keys() == churn_run.restored.keys()
    tokens = [o.prompt_tokens for o in churn_run.booted.values()]
    assert min(tokens) <= 8 and max(tokens) > 3 * churn.BLOCK, tokens
    assert max(tokens) + churn.MAX_TOKENS <= 512
    assert all(o.completion_tokens == churn.MAX_TOKENS for o in churn_run.booted.values())
    assert all(len(o.tokens) == churn.MAX_TOKENS for o in churn_run.booted.values())
    # The same text for every request, but where a request shared a batch with others
    # (vLLM's CPU kernels are not batch-invariant) a flipped near tie (churn.NEAR_TIE):
    # corrupted memory changes answers far more than that.
    alone = {r.key for rnd in churn.WORKLOAD if len(rnd) == 1 for r in rnd}
    diff = {}
    for k, b in churn_run.booted.items():
        r = churn_run.restored[k]
        if b == r:
            continue
        why = "sent alone" if k in alone else churn.near_tie_flip(b, r)
        if why is not None:
            diff[k] = (b, r, why)
    assert not diff, f"{len(diff)} of {len(churn_run.booted)} requests differ: {diff}"


def test_restored_tree_alive_with_mmap(churn_run: Churn) -> None:
    st = churn_run.status_after
    assert st["state"] == "Ready" and st["origin"] == "restored", st
    assert st["restored_with_mmap"] is True, st
    assert st["restore_memory"]["path"] == "mmap", st
    assert churn_run.alive_after and all(churn_run.alive_after.values()), churn_run.alive_after
    assert churn_run.restored_mem is not None and churn_run.booted_mem is not None
    # The same tree after the workload as right after the restore, and the booted tree's
    # processes (CRIU restores the pids inside the namespace).
    assert churn_run.restored_mem.pids == churn_run.tree_before
    assert sorted(churn_run.restored_mem.ns_pids) == sorted(churn_run.booted_mem.ns_pids)
    assert sorted(churn_run.restored_mem.comms) == sorted(churn_run.booted_mem.comms)


def test_restored_memory_comparable_and_mapped(churn_run: Churn) -> None:
    b, r = churn_run.booted_mem, churn_run.restored_mem
    assert b is not None and r is not None
    why = f"restored {r.summary()}\nbooted {b.summary()}\nimages {churn_run.images_kib >> 10} MiB"
    # The option took effect: parts of the restored processes' memory are the images,
    # still mapped after the churn.
    assert r.image_vmas > 0 and r.image_size > 0, why
    assert b.image_vmas == 0, why
    assert r.pss <= b.pss * churn.PSS_MARGIN, why
    # Most of the images stayed page cache (shared, reclaimable), not private copies.
    assert r.rss_anon <= churn_run.images_kib * churn.ANON_OF_IMAGES, why
