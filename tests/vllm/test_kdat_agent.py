"""The agent's CRIU kdat cache on a real restore: used, and a corrupt kept file is harmless.

The checkpointing agent leaves the cache in `<checkpoint root>/.criu-kdat/`;
a restoring agent installs it at /run/criu.kdat and CRIU loads it (its
restore log says so). An altered kept file is refused by the agent, made
again, and the restore goes on. /run is this machine's, shared with other
CRIU runs: another CRIU build's file put there at the same moment would make
CRIU log "Stale" (and probe) instead.

Both restore the session's tiny checkpoint (conftest's tiny_ckpt); the cache
is the one its checkpointing agent left in the session factory's checkpoint
root. (Agents with a signing key, whose kept file is signed and so not this
one, keep theirs under another root: test_agent_security.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rekindle_agent.restoring import kdat_cache

from .conftest import PROMPTS, AgentFactory, TinyCheckpoint

pytestmark = [pytest.mark.vllm, pytest.mark.criu]


def _kept(factory: AgentFactory) -> list[Path]:
    return sorted((factory.checkpoints / kdat_cache.CACHE_SUBDIR).glob("*.kdat"))


def _restore(factory: AgentFactory, ckpt: TinyCheckpoint, name: str) -> tuple[str, str]:
    """Restore from ckpt in a new "pod"; the agent's log and CRIU's restore log."""
    (factory.run_dir / "restore.log").unlink(missing_ok=True)
    agent = factory.start(name=name, restore_from=str(ckpt.path))
    try:
        st = agent.wait_ready(300)
        assert st.origin == "restored", (st.raw, agent.tail(100))
        assert agent.complete(PROMPTS[0]) == ckpt.before[0]  # the restored tree serves
        return agent.tail(400), (factory.run_dir / "restore.log").read_text(errors="replace")
    finally:
        agent.stop()


def _kdat_lines(log: str) -> str:
    return "\n".join(line for line in log.splitlines() if "kdat" in line)


def test_checkpoint_leaves_the_cache_and_the_restore_loads_it(
    agent_factory: AgentFactory, tiny_ckpt: TinyCheckpoint
) -> None:
    factory = agent_factory
    assert len(_kept(factory)) == 1  # made by the checkpointing agent, for this node
    agent_log, criu_log = _restore(factory, tiny_ckpt, "restore-cached")
    assert "CRIU kdat cache installed" in agent_log, agent_log[-3000:]
    kdat = _kdat_lines(criu_log)
    assert "Loaded kdat cache from" in kdat, kdat
    assert "does not exist" not in kdat, kdat


def test_a_corrupt_kept_cache_is_made_again(
    agent_factory: AgentFactory, tiny_ckpt: TinyCheckpoint
) -> None:
    factory = agent_factory
    (kept,) = _kept(factory)
    data = kept.read_bytes()
    kept.write_bytes(data[:-8] + bytes(8))  # the content no longer matches its digest
    agent_log, criu_log = _restore(factory, tiny_ckpt, "restore-corrupt")
    assert "ignoring kdat cache" in agent_log and "CRIU kdat cache produced" in agent_log
    assert kdat_cache.unwrap(kept.read_bytes())  # a good file again
    assert "Loaded kdat cache from" in _kdat_lines(criu_log)
