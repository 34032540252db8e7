"""The agent's CRIU kdat cache on a real restore: used, and a corrupt kept file is harmless.

The checkpointing agent leaves the cache in `<checkpoint root>/.criu-kdat/`;
a restoring agent installs it at /run/criu.kdat and CRIU loads it (its
restore log says so). An altered kept file is refused by the agent, made
again, and the restore goes on. /run is this machine's, shared with other
CRIU runs: another CRIU build's file put there at the same moment would make
CRIU log "Stale" (and probe) instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from rekindle_agent import kdat_cache

from .conftest import AgentFactory, factory_for

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def factory(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, criu_prefix: Path
) -> Iterator[AgentFactory]:
    yield from factory_for(tmp_path_factory, "kdat", tiny_model, criu_prefix)


@pytest.fixture(scope="module")
def ckpt(factory: AgentFactory) -> Path:
    agent = factory.start(name="boot")
    try:
        agent.wait_ready(600)
        path = factory.checkpoints / "k1"
        agent.client.checkpoint(str(path), timeout=900)
    finally:
        agent.stop()
    return path


def _kept(factory: AgentFactory) -> list[Path]:
    return sorted((factory.checkpoints / kdat_cache.CACHE_SUBDIR).glob("*.kdat"))


def _restore(factory: AgentFactory, ckpt: Path, name: str) -> tuple[str, str]:
    """Restore from ckpt in a new "pod"; the agent's log and CRIU's restore log."""
    (factory.run_dir / "restore.log").unlink(missing_ok=True)
    agent = factory.start(name=name, checkpoint=str(ckpt))
    try:
        st = agent.wait_ready(300)
        assert st.origin == "restored", (st.raw, agent.tail(100))
        assert agent.complete("The river", max_tokens=4)
        return agent.tail(400), (factory.run_dir / "restore.log").read_text(errors="replace")
    finally:
        agent.stop()


def _kdat_lines(log: str) -> str:
    return "\n".join(line for line in log.splitlines() if "kdat" in line)


def test_checkpoint_leaves_the_cache_and_the_restore_loads_it(
    factory: AgentFactory, ckpt: Path
) -> None:
    assert len(_kept(factory)) == 1  # made by the checkpointing agent, for this node
    agent_log, criu_log = _restore(factory, ckpt, "restore-cached")
    assert "CRIU kdat cache installed" in agent_log, agent_log[-3000:]
    kdat = _kdat_lines(criu_log)
    assert "Loaded kdat cache from" in kdat, kdat
    assert "does not exist" not in kdat, kdat


def test_a_corrupt_kept_cache_is_made_again(factory: AgentFactory, ckpt: Path) -> None:
    (kept,) = _kept(factory)
    data = kept.read_bytes()
    kept.write_bytes(data[:-8] + bytes(8))  # the content no longer matches its digest
    agent_log, criu_log = _restore(factory, ckpt, "restore-corrupt")
    assert "ignoring kdat cache" in agent_log and "CRIU kdat cache produced" in agent_log
    assert kdat_cache.unwrap(kept.read_bytes())  # a good file again
    assert "Loaded kdat cache from" in _kdat_lines(criu_log)
