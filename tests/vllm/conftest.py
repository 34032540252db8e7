"""Real-vLLM fixtures: the agent as a subprocess, in a fresh PID + mount namespace like a pod.

The launching itself is rekindle_dev.harness (shared with `rekindle-dev bench local`):
every port (the agent's and vLLM's) outside the ephemeral range, reported in --ports-file.
Agents run under `unshare --pid --fork --mount-proc --mount` with their own
tmpfs on /dev/shm, so a restore sees an empty /dev/shm and free PIDs exactly
as in a new pod, and the host's /dev/shm is never touched. Killing the
namespace's PID 1 (the agent) kills everything in it; stop() returns once the
namespace is empty and vLLM's port free.

A vLLM boot costs ~30-40 s on this 2-core machine and a checkpoint ~20 s, so
what several modules only need to read or restore from is made once per
session, on first use (a test run alone makes what it needs):

- tiny_ckpt: one boot of the tiny model that serves the churn workload (its
  outputs and memory are test_mmap_churn's reference), then is checkpointed
  under load; restored by test_agent_flow, test_agent_security, test_kdat_agent,
  test_resident_agent, test_foreign_vllm, test_router and test_mmap_churn (always in a new
  namespace, never changed: damage goes to a shadow_checkpoint copy);
- smollm2_ckpt: one boot of SmolLM2 that holds the KV test's conversation and
  the real-model answers, then is checkpointed; restored by test_real_model and
  test_kv_reuse.

Every agent of a factory shares vLLM's port (as pods of one service share a
Service): a test stops its agents before it returns, and a session fixture
stops its own before it hands its checkpoint over.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from rekindle_dev.harness import AgentFactory, AgentProc
from rekindle_dev.models import TinyModelSpec, generate_tiny_model

from tests.vllm import churn, smollm2_talk

__all__ = [
    "PROMPTS",
    "AgentFactory",
    "AgentProc",
    "SmolCheckpoint",
    "TinyCheckpoint",
    "edit_manifest",
    "factory_for",
    "shadow_checkpoint",
]

PROMPTS = [
    "The river",
    "Checkpoint and restore",
    "A winter garden in the city",
    "Tokens flow through the kernel",
    # Longer than a KV block (~260 tokens): after a restore this prompt would hit
    # the prefix cache, whose blocks' content was released with the KV cache.
    "The river flows past the stone bridge into the winter garden of the city, " * 12,
]
# Embedding and LM head 4 MiB each, the fused MLP weights 11 MiB per layer (bf16): tensors
# of 2 MiB and more, which PyTorch page-aligns under THP_MEM_ALLOC_ENABLE=1, so a reload
# can map them (the tiny model's tensors are all smaller).
WIDE = TinyModelSpec(
    hidden_size=1024,
    intermediate_size=2752,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
)
LOAD_WORKERS = 3
LOAD_DEADLINE_S = 180.0


def factory_for(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    model: Path,
    criu_prefix: Path,
    served_name: str = "tiny",
) -> Iterator[AgentFactory]:
    """The body of every AgentFactory fixture: root check, patched CRIU, stop all at the end."""
    if os.geteuid() != 0:
        pytest.fail("the agent's vLLM tests need root (CRIU, namespaces, mounts): run as root")
    f = AgentFactory(
        tmp_path_factory.mktemp(name), model, criu_prefix / "patched" / "criu", served_name
    )
    try:
        yield f
    finally:
        f.stop_all()
        f.remove_checkpoints()


@pytest.fixture(scope="session")
def agent_factory(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, criu_prefix: Path
) -> Iterator[AgentFactory]:
    yield from factory_for(tmp_path_factory, "agent", tiny_model, criu_prefix)


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_tiny_model(tmp_path_factory.mktemp("models") / "wide", WIDE)


@pytest.fixture(scope="session")
def smollm2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted SmolLM2-135M-Instruct (from the cache after the first run)."""
    from rekindle_dev.smollm2 import generate_smollm2

    return generate_smollm2(tmp_path_factory.mktemp("models") / "smollm2")


@pytest.fixture(scope="session")
def smollm2_factory(
    tmp_path_factory: pytest.TempPathFactory, smollm2_model: Path, criu_prefix: Path
) -> Iterator[AgentFactory]:
    yield from factory_for(
        tmp_path_factory, "agent-smollm2", smollm2_model, criu_prefix, smollm2_talk.SERVED
    )


# -- the tiny model's checkpoint ------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One request of the load around the checkpoint: what came back, and when (monotonic)."""

    worker: int
    kind: str  # "ok", "http 503", ... or "error"
    value: Any  # the text, the Retry-After header, or the error
    sent: float
    done: float


@dataclass
class TinyCheckpoint:
    """The session's tiny checkpoint and what its one boot served and measured."""

    path: Path
    manifest: dict[str, Any]
    before: list[str]  # PROMPTS on the booted server
    after_verify: list[str]  # PROMPTS on the checkpoint's proving restore
    status: dict[str, Any]  # the agent's status after the checkpoint (the proving restore)
    outcomes: list[Outcome] = field(default_factory=list)  # the load around the checkpoint
    window: tuple[float, float] = (0.0, 0.0)  # the checkpoint call: sent, answered
    churn_outputs: dict[str, churn.Out] = field(default_factory=dict)  # on the booted server
    churn_memory: churn.Memory | None = None  # the booted vLLM tree after the churn
    images_kib: int = 0  # its pages-*.img, all processes


def completions(agent: AgentProc) -> list[str]:
    return [agent.complete(p) for p in PROMPTS]


def _load(agent: AgentProc, stop: threading.Event, out: list[Outcome], worker: int) -> None:
    """Keep sending requests until told to stop; record each outcome."""
    n = 0
    while not stop.is_set():
        n += 1
        sent = time.monotonic()
        try:
            text = agent.complete(f"The river {worker} {n}", max_tokens=24, stream=(n % 2 == 0))
            out.append(Outcome(worker, "ok", text, sent, time.monotonic()))
        except urllib.error.HTTPError as e:
            retry = e.headers.get("Retry-After")
            out.append(Outcome(worker, f"http {e.code}", retry, sent, time.monotonic()))
            stop.wait(0.2)  # the client's back-off before it tries again
        except Exception as e:
            out.append(Outcome(worker, "error", repr(e), sent, time.monotonic()))


def _wait_for(what: str, done: Any, deadline_s: float = LOAD_DEADLINE_S) -> None:
    """Poll done() until true; fail naming what did not happen."""
    deadline = time.monotonic() + deadline_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"after {deadline_s:.0f}s: {what}")
        time.sleep(0.05)


def _checkpoint_under_load(agent: AgentProc, ckpt: Path, s: TinyCheckpoint) -> None:
    """Checkpoint while LOAD_WORKERS clients send requests: each has been served before the
    checkpoint starts, and is served again after it returned."""
    stop = threading.Event()
    workers = [
        threading.Thread(target=_load, args=(agent, stop, s.outcomes, i))
        for i in range(LOAD_WORKERS)
    ]
    for w in workers:
        w.start()
    try:
        _wait_for(
            "every load worker served once before the checkpoint",
            lambda: (
                {o.worker for o in list(s.outcomes) if o.kind == "ok"} == set(range(LOAD_WORKERS))
            ),
        )
        sent = time.monotonic()
        s.manifest = dict(agent.client.checkpoint(str(ckpt), timeout=900))
        s.window = (sent, time.monotonic())
        _wait_for(
            "every load worker served again after the checkpoint",
            lambda: (
                {o.worker for o in list(s.outcomes) if o.kind == "ok" and o.sent > s.window[1]}
                == set(range(LOAD_WORKERS))
            ),
        )
    finally:
        stop.set()
        for w in workers:
            w.join(180)


@pytest.fixture(scope="session")
def tiny_ckpt(agent_factory: AgentFactory) -> TinyCheckpoint:
    """One boot: PROMPTS, the churn workload and its memory, then a checkpoint under load."""
    ckpt = agent_factory.checkpoints / "tiny"
    agent = agent_factory.start(name="tiny-boot")
    try:
        st = agent.wait_ready(600)
        assert st.origin == "booted", st.raw
        s = TinyCheckpoint(ckpt, {}, completions(agent), [], {})
        s.churn_outputs = churn.run_workload(agent)
        s.churn_memory = churn.measure(churn.vllm_tree(agent, agent.status().raw["vllm_pid"]))
        _checkpoint_under_load(agent, ckpt, s)
        st = agent.wait_ready(60)
        assert st.origin == "restored", st.raw
        s.status = dict(st.raw)
        s.after_verify = completions(agent)
    except BaseException:
        print(agent.tail(200))
        raise
    finally:
        agent.stop()
    s.images_kib = sum(p.stat().st_size for p in (ckpt / "images").glob("pages-*.img")) >> 10
    return s


# -- SmolLM2's checkpoint ---------------------------------------------------------------


@dataclass
class SmolCheckpoint:
    """The session's SmolLM2 checkpoint and what its one boot said."""

    path: Path
    manifest: dict[str, Any]
    turns: list[smollm2_talk.Turn]  # the conversation, first thing on the fresh server
    before: smollm2_talk.Answers  # the real-model questions on the booted server
    verified: smollm2_talk.Answers  # the same on the checkpoint's proving restore


@pytest.fixture(scope="session")
def smollm2_ckpt(smollm2_factory: AgentFactory) -> SmolCheckpoint:
    """One boot (prefix caching on, the default): the conversation, the questions, a
    checkpoint, the questions again on the proving restore."""
    f = smollm2_factory
    agent = f.start(name="smollm2-boot", max_model_len=smollm2_talk.MAX_MODEL_LEN)
    try:
        st = agent.wait_ready(600)
        assert st.origin == "booted", st.raw
        turns = smollm2_talk.conversation(agent)
        before = smollm2_talk.ask(agent)
        ckpt = f.checkpoints / "smollm2"
        manifest = dict(agent.client.checkpoint(str(ckpt), timeout=900))
        st = agent.wait_ready(60)
        assert st.origin == "restored", st.raw
        verified = smollm2_talk.ask(agent)
    except BaseException:
        print(agent.tail(200))
        raise
    finally:
        agent.stop()
    return SmolCheckpoint(ckpt, manifest, turns, before, verified)


# -- damaging copies ----------------------------------------------------------------------


def shadow_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of a checkpoint made of symlinks (cheap), with real copies of the small files.

    Tests then damage the copy, never the shared original.
    """
    for dirpath, _dirs, files in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        (dst / rel).mkdir(mode=0o700, parents=True, exist_ok=True)
        for name in files:
            s, d = Path(dirpath) / name, dst / rel / name
            if name == "stats-restore":
                continue  # CRIU's output at each restore, not part of the checkpoint
            if name in ("manifest.json", "verified"):
                d.write_bytes(s.read_bytes())
            else:
                os.symlink(s, d)
    return dst


def edit_manifest(ckpt: Path, change: Any) -> None:
    path = ckpt / "manifest.json"
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))
