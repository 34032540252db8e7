"""Methods of Rekindle's vLLM worker extension, called over vLLM's /collective_rpc.

The agent calls them; rekindle_agent.worker.vllm_extension implements them inside
every vLLM worker. vLLM passes the class path to each worker process.
"""

from __future__ import annotations

WORKER_EXTENSION = "rekindle_agent.worker.vllm_extension.RekindleWorkerExtension"

DUMP_WEIGHTS = "rekindle_dump_weights"  # (dir) -> the flat weight dump, once
RELEASE_WEIGHTS = "rekindle_release_weights"  # () -> weights and KV cache freed (CPU)
RELOAD_WEIGHTS = "rekindle_reload_weights"  # (dir, verify=True) -> weights back in place
WORKER_INFO = "rekindle_worker_info"  # () -> what the worker holds now
WEIGHTS_DIGEST = "rekindle_weights_digest"  # () -> per-tensor digests (tests)
TIME_VLLM_RELOAD = "rekindle_time_vllm_reload"  # () -> vLLM's own loader, timed (bench)
