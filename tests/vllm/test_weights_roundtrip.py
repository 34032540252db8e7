"""Dump, release and reload the weights of a real vLLM CPU server through collective_rpc.

One server for the module (a boot costs ~30 s), of conftest's wide model:
its big tensors (2 MiB and more) are page-aligned by PyTorch
(THP_MEM_ALLOC_ENABLE=1, vllm_env's default on CPU), so a reload of an
immutable dump maps them. The oracle: per-tensor checksums computed inside
the worker, and greedy completions, before and after. Every test leaves the
server serving its own weights, copied (the mapped test ends with a copying
reload).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from rekindle_agent.mapped_files import immutable
from rekindle_contract import rpc
from rekindle_dev.vllm_runner import RpcError, VllmServer, complete, running_vllm
from rekindle_weights import format as fmt

pytestmark = pytest.mark.vllm

PROMPTS = ["The river", "Checkpoint and restore", "A winter garden in the city"]


def _rss(pid: int) -> int:
    """Resident memory of a process, read from /proc as any outside observer would."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _completions(server: VllmServer) -> list[str]:
    return [complete(server.url, "tiny", p, max_tokens=16) for p in PROMPTS]


@pytest.fixture(scope="module")
def weights_server(
    wide_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("weights-vllm") / "vllm.log"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("REKINDLE_MAP_WEIGHTS", raising=False)  # the default: map where it can
        with running_vllm(wide_model, log) as server:
            mp.undo()  # only the server's environment
            yield server


@pytest.fixture(scope="module")
def weights_dump(weights_server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("weights-dump")
    (res,) = weights_server.rpc(rpc.DUMP_WEIGHTS, str(d))
    assert res["rank"] == 0 and res["tensors"] > 0
    assert res["bytes"] == fmt.data_path(d, 0).stat().st_size
    json.dumps(res)  # the agent relays these as JSON
    return d


def test_dump_release_reload_is_bit_exact_and_frees_memory(
    weights_server: VllmServer, weights_dump: Path
) -> None:
    s = weights_server
    before = _completions(s)
    (digest0,) = s.rpc(rpc.WEIGHTS_DIGEST)
    index = fmt.read_index(weights_dump, 0)
    # The dump holds exactly what the worker holds, checksum for checksum.
    assert digest0 == {t.name: t.checksum for t in index.tensors}

    (info,) = s.rpc(rpc.WORKER_INFO)
    pid = info["pid"]
    rss_before = _rss(pid)
    (rel,) = s.rpc(rpc.RELEASE_WEIGHTS)
    rss_released = _rss(pid)
    assert rel["weight_bytes"] >= index.data_bytes * 0.9  # every weight, not just a few
    assert rel["kv_cache_bytes"] > 0
    dropped = rss_before - rss_released
    print(
        f"\nworker {pid} RSS {rss_before / 2**20:.0f} MiB -> {rss_released / 2**20:.0f} MiB "
        f"after release (dropped {dropped / 2**20:.0f} MiB; freed {rel['freed_bytes'] / 2**20:.0f} "
        f"MiB of weights+KV)"
    )
    assert dropped >= 0.8 * rel["freed_bytes"]

    (res,) = s.rpc(rpc.RELOAD_WEIGHTS, str(weights_dump))
    assert res["bytes"] == index.data_bytes and res["verified"] is True
    assert res["gbps"] > 0
    s.post("/reset_prefix_cache")
    (digest1,) = s.rpc(rpc.WEIGHTS_DIGEST)
    assert digest1 == digest0
    assert _completions(s) == before


def _broken_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_corrupt_dump_is_refused_naming_the_tensor_and_a_good_one_recovers(
    weights_server: VllmServer, weights_dump: Path, tmp_path: Path
) -> None:
    s = weights_server
    before = _completions(s)
    index = fmt.read_index(weights_dump, 0)
    victim = max(index.tensors, key=lambda t: t.nbytes)
    bad = _broken_copy(weights_dump, tmp_path / "corrupt")
    with open(fmt.data_path(bad, 0), "r+b") as f:
        f.seek(victim.offset + victim.nbytes // 2)
        b = f.read(1)
        f.seek(victim.offset + victim.nbytes // 2)
        f.write(bytes([b[0] ^ 0xFF]))

    pattern = rf"{re.escape(victim.name)}.*checksum mismatch"
    # Over live weights, and after a release: either way the worker ends up released
    # (not serving half-loaded weights), and a good dump brings it back.
    for release_first in (False, True):
        if release_first:
            s.rpc(rpc.RELEASE_WEIGHTS)
        with pytest.raises(RpcError, match=pattern):
            s.rpc(rpc.RELOAD_WEIGHTS, str(bad))
        (info,) = s.rpc(rpc.WORKER_INFO)
        assert info["released"] is True
        s.rpc(rpc.RELOAD_WEIGHTS, str(weights_dump))
        s.post("/reset_prefix_cache")
        assert _completions(s) == before


@pytest.mark.parametrize("damage", ["truncate", "dtype", "shape", "rename"])
def test_dump_that_does_not_match_is_refused_before_anything_is_written(
    weights_server: VllmServer, weights_dump: Path, tmp_path: Path, damage: str
) -> None:
    s = weights_server
    (digest0,) = s.rpc(rpc.WEIGHTS_DIGEST)
    bad = _broken_copy(weights_dump, tmp_path / damage)
    ipath = fmt.index_path(bad, 0)
    doc = json.loads(ipath.read_text())
    victim = doc["tensors"][len(doc["tensors"]) // 2]
    if damage == "truncate":
        victim = doc["tensors"][-1]
        with open(fmt.data_path(bad, 0), "r+b") as f:
            f.truncate(victim["offset"] + 1)
    elif damage == "dtype":
        victim["dtype"] = "float32" if victim["dtype"] != "float32" else "float16"
    elif damage == "shape":
        victim["shape"] = [*victim["shape"], 1]
    else:
        victim["name"] += ".renamed"
    ipath.write_text(json.dumps(doc))

    name = victim["name"].removesuffix(".renamed")
    with pytest.raises(RpcError, match=name.replace(".", r"\.")):
        s.rpc(rpc.RELOAD_WEIGHTS, str(bad))
    (digest1,) = s.rpc(rpc.WEIGHTS_DIGEST)
    assert digest1 == digest0  # validated before a single byte was written


def _maps_of(pid: int, path: Path) -> int:
    """How many of pid's mappings are of path (from /proc, as an outside observer)."""
    real = str(path.resolve())
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sum(1 for ln in lines if ln.endswith(" " + real))


def test_mapped_reload_is_bit_exact_and_release_unmaps(
    weights_server: VllmServer, tmp_path: Path
) -> None:
    s = weights_server
    before = _completions(s)
    (res,) = s.rpc(rpc.DUMP_WEIGHTS, str(tmp_path))
    data = fmt.data_path(tmp_path, 0)
    index = fmt.read_index(tmp_path, 0)
    (info,) = s.rpc(rpc.WORKER_INFO)
    pid = info["pid"]
    # A dump that can still change is never mapped: copied, and the answer says why.
    (rl,) = s.rpc(rpc.RELOAD_WEIGHTS, str(tmp_path), verify="false")
    assert rl["mapped_bytes"] == 0 and "not immutable" in rl["map"], rl
    assert _maps_of(pid, data) == 0
    failed = immutable.protect_weights(tmp_path)
    assert not failed, f"nothing would be mapped: {failed} (the tests' tmp must be ext4/xfs/...)"
    for _ in range(2):  # the second round releases memory that was mapped
        s.rpc(rpc.RELEASE_WEIGHTS)
        assert _maps_of(pid, data) == 0  # released memory is not a mapping of the dump
        (rl,) = s.rpc(rpc.RELOAD_WEIGHTS, str(tmp_path), verify="true")
        # The big tensors (2 MiB and more: nearly all of this model) are mapped, the rest read.
        assert rl["mapped_bytes"] >= 0.4 * index.data_bytes, rl
        assert rl["map"] == "mapped where page-aligned", rl
        assert _maps_of(pid, data) > 0
        s.post("/reset_prefix_cache")
        (digest,) = s.rpc(rpc.WEIGHTS_DIGEST)
        assert digest == {t.name: t.checksum for t in index.tensors}
        assert _completions(s) == before
    # A reload over mapped memory (no release in between) unmaps first and maps anew.
    (rl,) = s.rpc(rpc.RELOAD_WEIGHTS, str(tmp_path), verify="false")
    assert rl["mapped_bytes"] >= 0.4 * index.data_bytes
    assert _completions(s) == before
    # The caller's off switch: copied, and the mapping of the last reload is gone.
    (rl,) = s.rpc(rpc.RELOAD_WEIGHTS, str(tmp_path), verify="false", map_weights="false")
    assert rl["mapped_bytes"] == 0 and rl["map"] == "copied: map_weights=false", rl
    assert _maps_of(pid, data) == 0
    assert _completions(s) == before
    for p in (data, fmt.index_path(tmp_path, 0)):
        immutable.set_immutable(p, False)  # tmp_path can be cleaned up
    assert res["bytes"] == data.stat().st_size
