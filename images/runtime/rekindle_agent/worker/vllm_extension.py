"""Rekindle's vLLM worker extension: dump, release and reload weights over collective_rpc.

Start vLLM with `--worker-extension-cls
rekindle_agent.worker.vllm_extension.RekindleWorkerExtension` (rekindle_contract.rpc's
WORKER_EXTENSION; the agent's vLLM command line has it) and
`VLLM_SERVER_DEV_MODE=1`; then `POST /collective_rpc` with
`{"method": M, "args": [...], "kwargs": {...}}` answers `{"results": [one per worker]}`.
Every method returns a JSON-serializable dict. The interface (names in
rekindle_contract.rpc):

- `rekindle_dump_weights(dir) -> {"rank", "bytes", "seconds", "tensors", "coverage", ...}`
  writes `dir/weights-rank{R}.bin` and `dir/weights-rank{R}.json` (rekindle_weights.format):
  every parameter and buffer exactly as it sits in the loaded model. It first
  checks that they cover all the memory a release frees (rekindle_weights.dump.coverage:
  whole storages on every device; on CUDA also every live block of vLLM's
  "weights" memory) and refuses, naming the gap, when they do not.
- `rekindle_release_weights() -> {"rank", "freed_bytes", ...}` drops the weights'
  and the KV cache's memory. On CPU this is real work (vLLM's sleep is a no-op
  there): every storage is shrunk to 0 bytes (the Parameter objects and their
  views stay), CPU GEMM handlers holding packed copies are dropped, then
  gc + malloc_trim return the memory to the OS. On GPU, vLLM's
  `POST /sleep?level=2` releases memory (keeping virtual addresses) and this
  call only reports that.
- `rekindle_reload_weights(dir, verify="true", threads=None, map_weights=None) ->
  {"rank", "bytes", "seconds", "gbps", "mapped_bytes", "map", ...}` refills every
  tensor in place from the dump (on CPU after re-allocating what release freed;
  on GPU after `POST /wake_up?tags=weights`). The caller then calls `POST
  /reset_prefix_cache` (the KV cache's content is gone) and, on GPU, `POST
  /wake_up?tags=kv_cache`. On CPU, when the dump's data file is immutable
  (chattr +i: a proven checkpoint, immutable.protect_weights), the page-aligned
  part of each tensor is mapped from the dump instead of copied
  (rekindle_weights.reload.map_range: no first-touch faults on fresh memory);
  `map` says why or why not (rekindle_agent.mapped_files.weights_map.map_choice). Off with
  REKINDLE_MAP_WEIGHTS=0 in the server's environment or map_weights=false.
  Release and the next reload turn those ranges back into anonymous memory first.
- `rekindle_weights_digest() -> {name: checksum}`: per-tensor block CRC-32s
  (rekindle_weights.format), to prove a round trip bit-exact.
- `rekindle_worker_info() -> {"rank", "pid", "rss_bytes", "released"}`.
- `rekindle_time_vllm_reload() -> {"rank", "seconds"}`: vLLM's `reload_weights`
  timed in the worker (the benchmark's baseline).

Between release and reload the model must not run: drain requests first.

CPU detail: vLLM's CPU linear layers pack their weight into a oneDNN (or
sgl) handler and replace the Parameter with an empty one, which would leave
the real weights outside any tensor. Importing this module in a CPU worker
(vLLM imports it before loading the model) makes that dispatch keep the
Parameter (`remove_weight=False`), so the dump holds the weights; reload
rebuilds the handlers from the refilled Parameters. Cost: the linear weights
are held twice on CPU. Set REKINDLE_CPU_KEEP_WEIGHTS=0 to turn this off (dump
and reload then refuse a model whose weights were removed).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rekindle_weights import format as fmt
from rekindle_weights.dump import coverage, dump_tensors
from rekindle_weights.reload import (
    ReloadOptions,
    load_into,
    release_staging_buffers,
    unmap_ranges,
    validate,
)
from rekindle_weights.tensors import byte_tensor, host_bytes, model_tensors

from rekindle_agent.mapped_files.weights_map import map_choice

if TYPE_CHECKING:
    import torch


def _truthy(v: object) -> bool:
    """collective_rpc passes JSON values through, often as strings: accept both."""
    if isinstance(v, str):
        return v.strip().lower() not in ("", "0", "false", "no", "off")
    return bool(v)


def _opt_int(v: object) -> int | None:
    if v is None or v == "":
        return None
    return int(v)  # type: ignore[call-overload]


def _rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _malloc_trim() -> None:
    """Give freed heap pages back to the OS, so RSS (and a CRIU image) really shrinks."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# ---------------------------------------------------------------- CPU GEMM handlers


def _keep_cpu_linear_weights() -> None:
    """Make vLLM's CPU GEMM dispatch keep the weight Parameter (see module docstring)."""
    if os.environ.get("REKINDLE_CPU_KEEP_WEIGHTS", "1") == "0":
        return
    try:
        from vllm.model_executor.layers import utils as layer_utils
        from vllm.platforms import current_platform
    except ImportError:
        return
    if not current_platform.is_cpu():
        return
    orig = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(orig, "_rekindle", False):
        return

    def dispatch_keeping_weight(layer: Any, remove_weight: bool) -> None:
        # Only 2-D (linear) weights: the handler is rebuilt from them after a reload.
        # Others (e.g. causal-conv prepacking) rewrite the weight itself, which the dump keeps.
        linear = getattr(getattr(layer, "weight", None), "ndim", 0) == 2
        orig(layer, remove_weight=False)
        if linear:
            layer._rekindle_redispatch = True

    dispatch_keeping_weight._rekindle = True  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight


_keep_cpu_linear_weights()


def _released_linear(*args: object, **kwargs: object) -> None:
    raise RuntimeError(
        "this layer's weights were released by rekindle_release_weights; "
        "call rekindle_reload_weights before serving"
    )


def _drop_cpu_handlers(model: torch.nn.Module) -> None:
    """Replace CPU GEMM closures (which own packed weight copies) by a stub that raises."""
    for m in model.modules():
        if getattr(m, "_rekindle_redispatch", False) and callable(getattr(m, "cpu_linear", None)):
            setattr(m, "cpu_linear", _released_linear)  # noqa: B010 (Module typing)


def _rebuild_cpu_handlers(layers: list[torch.nn.Module]) -> None:
    if not layers:
        return
    from vllm.model_executor.layers import utils as layer_utils

    for m in layers:
        layer_utils.dispatch_cpu_unquantized_gemm(m, remove_weight=False)


# ---------------------------------------------------------------- storages


def _storages(tensors: list[torch.Tensor]) -> dict[int, tuple[Any, int]]:
    """Distinct live storages behind tensors: data_ptr -> (storage, nbytes)."""
    out: dict[int, tuple[Any, int]] = {}
    for t in tensors:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr and ptr not in out:
            out[ptr] = (s, s.nbytes())
    return out


def _flatten(obj: object) -> list[torch.Tensor]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, list | tuple):
        return [t for o in obj for t in _flatten(o)]
    return []


def _kv_cache_tensors(runner: Any) -> list[torch.Tensor]:
    """The KV cache: the runner's list plus what attention layers hold (views of the same)."""
    tensors = _flatten(getattr(runner, "kv_caches", []))
    ctx = getattr(getattr(runner, "compilation_config", None), "static_forward_context", {})
    for layer in (ctx or {}).values():
        tensors += _flatten(getattr(layer, "kv_cache", None))
    return tensors


def _weight_pool_blocks() -> list[tuple[int, int]] | None:
    """(address, bytes) of every live PyTorch block inside vLLM's "weights" memory (CUDA).

    vLLM's sleep mode allocates through its CuMem allocator, which tags each
    allocation; level 2 discards those tagged "weights". PyTorch's snapshot
    lists the live blocks carved out of them, by their requested size (the
    allocator rounds blocks up). None when that allocator is not in use
    (nothing is discarded then). Not yet run on a GPU (docs/gpu.md).
    """
    try:
        import torch
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError:
        return None
    pools = [
        (int(ptr), int(data.handle[1]))
        for ptr, data in CuMemAllocator.get_instance().pointer_to_data.items()
        if data.tag == "weights"
    ]
    if not pools:
        return None
    blocks = []
    for seg in torch.cuda.memory_snapshot():
        for b in seg.get("blocks", []):
            if b.get("state") != "active_allocated":
                continue
            addr = int(b["address"])
            if any(a <= addr < a + n for a, n in pools):
                blocks.append((addr, int(b.get("requested_size") or b["size"])))
    return blocks


@dataclass
class _Released:
    """What release freed, so reload can re-allocate exactly that."""

    weights: list[tuple[Any, int]] = field(default_factory=list)
    kv: list[tuple[Any, int]] = field(default_factory=list)

    @property
    def weight_bytes(self) -> int:
        return sum(n for _, n in self.weights)

    @property
    def kv_bytes(self) -> int:
        return sum(n for _, n in self.kv)


def _shrink(storages: dict[int, tuple[Any, int]]) -> list[tuple[Any, int]]:
    freed = []
    for s, n in storages.values():
        s.resize_(0)
        freed.append((s, n))
    return freed


def _regrow(freed: list[tuple[Any, int]]) -> None:
    for s, n in freed:
        s.resize_(n)


# ---------------------------------------------------------------- the extension


class RekindleWorkerExtension:
    """Mixed into every vLLM worker; methods are called through collective_rpc.

    Only `rekindle_`-prefixed attributes: vLLM asserts the extension adds no
    name the worker already has.
    """

    model_runner: Any
    rank: int
    device: Any
    _rekindle_released: _Released | None  # annotation only: no class attribute to clash
    _rekindle_mapped: tuple[tuple[int, int], ...]  # ranges the last reload mapped (map_file)

    def _rekindle_model(self) -> torch.nn.Module:
        model: torch.nn.Module = self.model_runner.get_model()
        return model

    def _rekindle_state(self) -> _Released | None:
        return getattr(self, "_rekindle_released", None)

    def _rekindle_named(self) -> dict[str, torch.Tensor]:
        return {name: t for name, _, t in model_tensors(self._rekindle_model())}

    def rekindle_worker_info(self) -> dict[str, Any]:
        return {
            "rank": int(self.rank),
            "pid": os.getpid(),
            "rss_bytes": _rss_bytes(),
            "released": self._rekindle_state() is not None,
        }

    def rekindle_dump_weights(self, directory: str) -> dict[str, Any]:
        if self._rekindle_state() is not None:
            raise RuntimeError("weights are released: reload them before dumping")
        self._rekindle_check_not_removed()
        tensors = list(model_tensors(self._rekindle_model()))
        live = _weight_pool_blocks() if self.device.type == "cuda" else None
        cov = coverage(tensors, live)
        if not cov.complete:
            raise RuntimeError(
                "the weight dump would not hold every byte the release frees: "
                + "; ".join(cov.problems)
            )
        res = dump_tensors(tensors, directory, int(self.rank))
        return {**res.to_json(), "coverage": cov.to_json()}

    def _rekindle_check_not_removed(self) -> None:
        """Refuse models whose CPU linear weights live only in packed handlers."""
        for m in self._rekindle_model().modules():
            w = getattr(m, "weight", None)
            if callable(getattr(m, "cpu_linear", None)) and w is not None and w.numel() == 0:
                raise RuntimeError(
                    "vLLM removed this model's CPU linear weights into packed handlers "
                    "(REKINDLE_CPU_KEEP_WEIGHTS=0): unset it and restart vLLM to dump"
                )

    def rekindle_release_weights(self) -> dict[str, Any]:
        if self._rekindle_state() is not None:
            return {"rank": int(self.rank), "freed_bytes": 0, "already_released": True}
        staging = release_staging_buffers()
        if self.device.type != "cpu":
            # GPU: /sleep?level=2 unmaps weights and KV cache (virtual addresses kept).
            return {"rank": int(self.rank), "freed_bytes": staging, "mode": "vllm-sleep"}
        rss0 = _rss_bytes()
        self._rekindle_unmap()  # freed memory must not stay a mapping of the dump
        model = self._rekindle_model()
        _drop_cpu_handlers(model)
        state = _Released()
        weights = _storages([t for _, _, t in model_tensors(model)])
        kv = {
            p: v
            for p, v in _storages(_kv_cache_tensors(self.model_runner)).items()
            if p not in weights
        }
        state.weights = _shrink(weights)
        state.kv = _shrink(kv)
        self._rekindle_released = state
        gc.collect()
        _malloc_trim()
        return {
            "rank": int(self.rank),
            "freed_bytes": state.weight_bytes + state.kv_bytes,
            "weight_bytes": state.weight_bytes,
            "kv_cache_bytes": state.kv_bytes,
            "rss_before": rss0,
            "rss_after": _rss_bytes(),
        }

    def rekindle_reload_weights(
        self,
        directory: str,
        verify: object = True,
        threads: object = None,
        map_weights: object = None,
    ) -> dict[str, Any]:
        t0 = time.perf_counter()
        rank = int(self.rank)
        index = fmt.read_index(directory, rank)
        ordered = validate(index, self._rekindle_named())  # before any allocation or write
        state = self._rekindle_state()
        self._rekindle_unmap()  # this reload refills (or maps) that memory anew
        if state is not None:
            _regrow(state.weights)
        data = fmt.data_path(directory, rank)
        asked = None if map_weights is None or map_weights == "" else _truthy(map_weights)
        map_file, why = map_choice(self.device.type, data, asked)
        opts = ReloadOptions(verify=_truthy(verify), threads=_opt_int(threads), map_file=map_file)
        try:
            res = load_into(index, data, ordered, opts)
        except BaseException:
            # Some bytes may already be in place: on CPU leave the worker visibly released
            # (requests fail, worker_info says so) rather than serving half-loaded weights.
            if self.device.type == "cpu":
                _drop_cpu_handlers(self._rekindle_model())
                shrunk = _shrink(_storages(ordered))
                if state is None:
                    self._rekindle_released = _Released(weights=shrunk)
            raise
        finally:
            release_staging_buffers()  # no pinned host memory left behind in the server
        self._rekindle_mapped = res.mapped
        t_regrow = time.perf_counter()
        if state is not None:
            _regrow(state.kv)
            self._rekindle_released = None
        # Packed CPU GEMM copies must follow the new bytes (a reload need not follow a release).
        t_repack = time.perf_counter()
        _rebuild_cpu_handlers(
            [
                m
                for m in self._rekindle_model().modules()
                if getattr(m, "_rekindle_redispatch", False)
            ]
        )
        out = res.to_json()
        # The reload proper (read or map the dump) apart from what follows it: on CPU
        # the GEMM handlers repack every linear weight into fresh memory, which costs
        # more than mapping the dump at every size measured (docs/restore-profile.md).
        out["read_seconds"] = round(res.seconds, 6)
        out["kv_regrow_seconds"] = round(t_repack - t_regrow, 6)
        out["repack_seconds"] = round(time.perf_counter() - t_repack, 6)
        out["total_seconds"] = round(time.perf_counter() - t0, 6)
        out["map"] = f"{why}; {res.map_note}" if res.map_note else why
        # One line in vLLM's log: how each reload brought the weights back.
        print(
            f"rekindle: reload rank {rank}: {res.bytes} bytes, {res.mapped_bytes} mapped "
            f"from {data} ({out['map']}), {out['total_seconds']:.3f}s (read "
            f"{out['read_seconds']:.3f}s, CPU GEMM repack {out['repack_seconds']:.3f}s)",
            file=sys.stderr,
            flush=True,
        )
        return out

    def _rekindle_unmap(self) -> None:
        unmap_ranges(getattr(self, "_rekindle_mapped", ()))
        self._rekindle_mapped = ()

    def rekindle_time_vllm_reload(self) -> dict[str, Any]:
        """vLLM's own `reload_weights` timed inside the worker (the benchmark's baseline)."""
        t0 = time.perf_counter()
        self.model_runner.reload_weights()
        return {"rank": int(self.rank), "seconds": round(time.perf_counter() - t0, 6)}

    def rekindle_weights_digest(self) -> dict[str, str]:
        if self._rekindle_state() is not None:
            raise RuntimeError("weights are released: nothing to digest")
        out = {}
        for name, _, t in model_tensors(self._rekindle_model()):
            dense = t.contiguous()
            if dense.device.type != "cpu":
                dense = byte_tensor(dense).cpu()
            out[name] = fmt.format_checksum(fmt.block_crcs(host_bytes(dense)))
        return out
