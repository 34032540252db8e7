"""An agent never serves a vLLM it did not start (real agents, real vLLM, one shared port).

Agents of one AgentFactory share vLLM's port and the host's network, as pods
with hostNetwork would. Before the agent refused a foreign vLLM, a second
agent started while the first one's vLLM was up reported "Ready booted": its
own vLLM could not bind the port, and /health was answered by the first
one's server until its own died. Now the second agent goes Failed with a
message naming the port and what to change, and the first keeps serving.

The first agent restores the session's tiny checkpoint (a restored vLLM holds
the port as a booted one does, in seconds); the race is of two real boots.
"""

from __future__ import annotations

import time

import pytest

from tests.vllm.conftest import PROMPTS, AgentFactory, AgentProc, TinyCheckpoint

pytestmark = [pytest.mark.vllm]


def settle(agent: AgentProc, timeout: float = 900) -> tuple[str, str, bool]:
    """(final state, its message, whether Ready was ever seen) once Ready or Failed."""
    seen_ready = False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = agent.wait_state(("Ready", "Failed", "Booting"), timeout=timeout)
        seen_ready |= st.state == "Ready"
        if st.state in ("Ready", "Failed"):
            return st.state, st.message, seen_ready
        time.sleep(0.2)
    raise TimeoutError(f"agent neither Ready nor Failed after {timeout}s:\n{agent.tail()}")


@pytest.mark.criu
def test_second_agent_refuses_a_running_vllm(
    agent_factory: AgentFactory, tiny_ckpt: TinyCheckpoint
) -> None:
    factory = agent_factory
    first = factory.start(name="first", restore_from=str(tiny_ckpt.path))
    try:
        assert first.wait_ready(300).origin == "restored"
        answer = first.complete(PROMPTS[0])
        assert answer == tiny_ckpt.before[0]
        second = factory.start(name="second")
        try:
            state, message, seen_ready = settle(second, 300)
            print(f"second agent: {state}: {message}")
        finally:
            second.stop()
        assert state == "Failed" and not seen_ready, (state, message)
        assert f"port {factory.vllm_port} is already in use" in message, message
        assert "--vllm-port" in message, message  # says what to change
        assert first.complete(PROMPTS[0]) == answer  # the first server was left alone
    except BaseException:
        print(first.tail(100))
        raise
    finally:
        first.stop()


def test_agents_booting_together_one_serves(agent_factory: AgentFactory) -> None:
    """Both spawn before either vLLM listens: the port check cannot tell, the rest must.

    Whichever vLLM binds first serves; the other agent fails (its vLLM dies on
    the port, or /health is answered by a socket its tree does not hold)
    and is never Ready.
    """
    a = agent_factory.start(name="race-a")
    b = agent_factory.start(name="race-b")
    try:
        results = [settle(a), settle(b)]
        print(f"race: {results}")
    except BaseException:
        print(a.tail(100), b.tail(100), sep="\n")
        raise
    finally:
        for agent in (a, b):
            agent.stop()
    states = sorted(r[0] for r in results)
    assert states == ["Failed", "Ready"], results
    failed = next(r for r in results if r[0] == "Failed")
    assert not failed[2], results  # the loser never reported Ready
