"""Tensor parallel on CPU (TP=2): a two-worker vLLM tree checkpointed and restored.

vLLM's CPU build always runs the multiprocess executor; with
--tensor-parallel-size 2 the engine core has two worker processes, each with
half of every sharded weight, talking over shared-memory message queues in
/dev/shm and a gloo process group. One boot through the agent (its checkpoint
includes the agent's proving restore), then a restore in a fresh namespace
like a new pod: both workers must come back with bit-identical weights, greedy
answers must match the booted server's one by one, a concurrent batch must be
answered whole (its text depends on how requests share steps: Served.same_as),
and /dev/shm must stay within what the operator budgets for TP=2.

Which all-reduce the ranks use is asserted from the log, against what the
host can do: vLLM's shared-memory all-reduce exists only in its AVX-512
kernel library (vllm/_C); on a CPU without AVX-512 vLLM loads _C_AVX2, which
lacks those ops, and each worker logs "CPU SHM communicator disabled ...
ranks do not share the same SHM group name" (that wording covers every
reason it is off, here the missing ops) and all-reduces over gloo.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from rekindle_contract import rpc
from rekindle_dev.vllm_runner import collective_rpc
from rekindle_operator.shm_sizing import shm_need
from rekindle_operator.spec import IsvcSpec

from tests.vllm.conftest import PROMPTS, AgentFactory, AgentProc, factory_for

pytestmark = [pytest.mark.vllm, pytest.mark.criu]

TP = 2
WORKER_TITLE = "VLLM::Worker_TP"  # vLLM's process title of a worker: VLLM::Worker_TP<rank>
BATCH = [*PROMPTS, "Stone bridge over the river", "Memory pages of a process"]
# What each worker logs when vLLM's CPU shared-memory all-reduce is off for its TP group.
SHM_OFF = "CPU SHM communicator disabled for group tp:"
HAS_SHM_OPS = (
    "import torch; from vllm.platforms import current_platform as p; "
    "p.import_kernels(); print(hasattr(torch.ops._C, 'init_shm_manager'))"
)


def shm_allreduce_built() -> bool:
    """Whether the kernel library vLLM loads on this CPU has the shared-memory all-reduce.

    Asked of vLLM itself in a child (as a worker loads it): the AVX-512 build
    registers init_shm_manager and its all-reduce ops, the AVX2 build does not.
    """
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", HAS_SHM_OPS],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1] == "True"


@dataclass
class Served:
    """What one server said and held."""

    sequential: list[str] = field(default_factory=list)
    batch: list[str] = field(default_factory=list)
    digests: list[dict[str, str]] = field(default_factory=list)  # per rank

    def same_as(self, other: Served) -> bool:
        """The oracle: the same weights, bit for bit, and the same greedy answers one by
        one; a concurrent batch must be answered, whole, but its text is not compared:
        vLLM's CPU GEMMs are not batch-invariant, and which requests share a step depends
        on when they arrive (on AVX-512 this random model's near ties flip with it)."""
        answered = len(other.batch) == len(BATCH) and all(other.batch)
        return answered and (self.sequential, self.digests) == (other.sequential, other.digests)


def ask(agent: AgentProc, factory: AgentFactory) -> Served:
    out = Served(sequential=[agent.complete(p, max_tokens=16) for p in PROMPTS])
    with ThreadPoolExecutor(len(BATCH)) as pool:
        out.batch = list(pool.map(lambda p: agent.complete(p, max_tokens=16), BATCH))
    # collective_rpc answers in rank order: the digests are rank 0's, then rank 1's.
    infos = collective_rpc(factory.vllm_port, rpc.WORKER_INFO)
    assert [i["rank"] for i in infos] == list(range(TP)), infos
    assert not any(i["released"] for i in infos), infos
    out.digests = collective_rpc(factory.vllm_port, rpc.WEIGHTS_DIGEST)
    return out


def tree_cmdlines(root: int) -> list[str]:
    """Command lines (process titles) of root's descendants, from the host's /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            try:
                raw = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            out.append(raw.replace(b"\0", b" ").decode(errors="replace").strip())
            todo.append(child)
    return out


def shm_usage(agent: AgentProc) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of the files in the agent's private /dev/shm."""
    shm = Path(f"/proc/{agent.proc.pid}/root/dev/shm")
    apparent = allocated = 0
    for p in shm.iterdir():
        st = p.lstat()
        apparent += st.st_size
        allocated += st.st_blocks * 512
    return apparent, allocated


def shm_budget() -> int:
    """What the operator gives /dev/shm for a CPU TP=2 text model (no multimodal cache)."""
    spec = IsvcSpec(
        name="tp2",
        namespace="t",
        model_source="/models/tiny",
        served_name="tiny",
        tensor_parallel_size=TP,
        mm_shm_cache=False,
    )
    return shm_need(spec).total


@pytest.fixture(scope="module")
def factory(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, criu_prefix: Path
) -> Iterator[AgentFactory]:
    yield from factory_for(tmp_path_factory, "agent-tp2", tiny_model, criu_prefix)


def test_tp2_checkpoint_restore_same_answers(factory: AgentFactory) -> None:
    budget = shm_budget()
    agent = factory.start(name="boot-tp2", tensor_parallel_size=TP)
    # Asked of vLLM in a child while the agent boots (a few seconds of imports).
    probe = ThreadPoolExecutor(1)
    shm_built = probe.submit(shm_allreduce_built)
    probe.shutdown(wait=False)
    try:
        assert agent.wait_ready(900).origin == "booted"
        workers = [c for c in tree_cmdlines(agent.proc.pid) if c.startswith(WORKER_TITLE)]
        assert sorted(workers) == [f"{WORKER_TITLE}{r}" for r in range(TP)], workers
        before = ask(agent, factory)
        booted_shm = shm_usage(agent)
        shm_off_lines = agent.log.read_text(errors="replace").count(SHM_OFF)
        ckpt = factory.checkpoints / "tp2"
        manifest = agent.client.checkpoint(str(ckpt), timeout=900)
        assert agent.wait_ready(120).origin == "restored"
        proved = ask(agent, factory)  # after the agent's proving restore
        assert before.same_as(proved), (before, proved)
    except BaseException:
        print(agent.tail(200))
        raise
    finally:
        agent.stop()
    assert manifest["weights"]["released"], manifest["weights"]
    ranks = sorted(f["path"] for f in manifest["files"] if f["path"].startswith("weights/"))
    assert any("rank0" in p for p in ranks) and any("rank1" in p for p in ranks), ranks
    assert len(set(before.sequential)) > 1, before  # the prompts give different answers
    assert len(before.batch) == len(BATCH) and all(before.batch), before  # (Served.same_as)
    assert before.digests[0] != before.digests[1]  # each rank holds its own shard
    # Shared-memory all-reduce where vLLM's kernels have it, else every rank says gloo.
    shm_on = shm_built.result(300)
    print(f"shared-memory all-reduce built: {shm_on}; 'disabled' lines: {shm_off_lines}")
    assert shm_off_lines == (0 if shm_on else TP), (shm_on, shm_off_lines)
    print(f"/dev/shm booted: apparent {booted_shm[0]}, allocated {booted_shm[1]}, budget {budget}")
    assert booted_shm[0] <= budget and booted_shm[1] <= budget, (booted_shm, budget)

    agent = factory.start(name="restore-tp2", tensor_parallel_size=TP, restore_from=str(ckpt))
    try:
        st = agent.wait_ready(300)
        assert st.origin == "restored" and st.last_fallback is None, st.raw
        assert "reload_weights" in st.timings["restore"], st.timings
        workers = [c for c in tree_cmdlines(agent.proc.pid) if c.startswith(WORKER_TITLE)]
        assert sorted(workers) == [f"{WORKER_TITLE}{r}" for r in range(TP)], workers
        after = ask(agent, factory)
        restored_shm = shm_usage(agent)
        restored_log = agent.log.read_text(errors="replace")
    except BaseException:
        print(agent.tail(200))
        raise
    finally:
        agent.stop()
    assert after.digests == before.digests  # both ranks reloaded bit for bit
    assert before.same_as(after), (before, after)
    assert SHM_OFF not in restored_log  # restored ranks keep their communicator: no new setup
    print(f"/dev/shm restored: apparent {restored_shm[0]}, allocated {restored_shm[1]}")
    assert restored_shm[0] <= budget and restored_shm[1] <= budget, (restored_shm, budget)
