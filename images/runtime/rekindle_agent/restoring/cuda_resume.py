"""Whether CUDA really resumed in a restored tree: CRIU 4.2.x exits 0 when it did not.

The CUDA plugin's late resume hook logs a failed `cuda-checkpoint --action
restore` and CRIU still exits 0. Seen on an H100 (driver 580, a device map
naming a GPU the process never used): the process stayed 'checkpointed' and
blocked at its first CUDA call, so the agent would wait on vLLM's health
until its timeout. Asked right after CRIU instead: every process of the tree
that CUDA knows must be 'running'. A process CUDA does not know (cuda-checkpoint
answers with an error) has nothing to resume.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rekindle_agent.checkpointing.gpu_preflight import Runner, run_command


def states(cuda_checkpoint: str, pids: Sequence[int], run: Runner = run_command) -> dict[int, str]:
    """pid -> its CUDA state ('running', 'locked', 'checkpointed', ...), for the
    processes CUDA knows."""
    out = {}
    for pid in pids:
        code, text = run([cuda_checkpoint, "--get-state", "--pid", str(pid)])
        words = text.split()
        if code == 0 and words:
            out[pid] = words[0]
    return out


def not_resumed(found: Mapping[int, str]) -> list[str]:
    """Each process whose CUDA state is not 'running', as 'pid N is STATE'."""
    return [f"pid {pid} is {state}" for pid, state in sorted(found.items()) if state != "running"]
