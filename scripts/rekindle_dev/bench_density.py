"""`rekindle-dev bench density`: the memory of N real vLLM replicas restored from ONE checkpoint.

One agent boots the tiny model (rekindle_dev.models) and makes a checkpoint; then, for
each N in --replicas and each mode, N agents restore that checkpoint at the same time on
this node, the way N pods of one InferenceService would:
  mmap   the patched CRIU, the agent's zero-copy restore (mmap_restore auto; the run
         fails if the agent did not map)
  stock  stock CRIU, the agent's copying restore (mmap_restore off)
Each replica is measured right after it is Ready and again after a workload (every
replica answers --prompts greedy completions of --max-tokens tokens, which must equal
the booted server's answers before the checkpoint):
  per replica  the sum over every process of its tree (agent, vLLM API server, engine
               core, worker) of /proc/PID/smaps_rollup: Pss, Pss_Anon, Pss_File,
               Pss_Shmem, Rss;
  its memcg    memory.stat (cache, rss, mapped_file, shmem), usage and peak: what a
               pod's memory limit sees (docs/memory.md says how page cache is charged);
  the node     /proc/meminfo deltas against the moment before the restores: used
               (MemTotal - MemAvailable, also with the per-cpu free lists counted as
               free), AnonPages, Cached, Shmem.

Every replica is a pod-like sandbox made by this run, on this machine:
  - its own memory cgroup (v1 here; v2 where that is what the node has), joined before
    anything of it starts, so every page it touches first is charged to it;
  - its own network namespace (`unshare --net`, loopback up): a restored vLLM tree
    listens again on the ports it had at dump time, so N replicas of one checkpoint
    cannot share one; requests are sent from inside (setns on this thread), nothing
    leaves the machine;
  - its own PID and mount namespaces with the agent as PID 1, a private /dev/shm tmpfs,
    and a private run dir bind-mounted over the path the checkpoint names (vLLM's log
    and TMPDIR), as the harness's agents have (rekindle_dev.harness).
The agent's argv is AgentFactory.args + rekindle_contract's agent_argv, as for the tests.

Page cache: --caches cold drops it before each group's restores (the replicas' own reads
are then charged to them: first toucher pays); warm reads the checkpoint first from this
process (charged to this process's cgroup, not to any replica). Trials are interleaved
(every N and mode once per trial, the modes' order alternating). Results: results.json
(per-trial, per-replica values and medians), results.md, results.png.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rekindle_contract.agent_args import agent_argv
from rekindle_contract.manifest import Manifest

from rekindle_dev.bench_common import fmt, md_table, provenance, pyplot, save_figure
from rekindle_dev.harness import AGENT_COMMAND, AgentFactory, AgentProc

MODES: dict[str, dict[str, Any]] = {
    "stock": {"mmap_restore": "off"},
    "mmap": {"mmap_restore": "auto"},
}
MODE_LABELS = {"stock": "stock CRIU (copy)", "mmap": "`--mmap-restore`"}
# A few different prompts: greedy answers of the seeded tiny model are the oracle.
PROMPTS = (
    "The river",
    "Checkpoint and restore the",
    "A cold start of the kernel",
    "Memory of the pod",
    "The page cache is",
    "Light on the mountain road",
    "Shared weights of the model",
    "When the winter",
)
SMAPS_KEYS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")
MEMINFO_KEYS = ("used", "used_pcp", "pcp_free", "AnonPages", "Cached", "Shmem")
MEMCG_KEYS = ("rss", "cache", "mapped_file", "shmem", "usage", "peak")
# cgroup v2's memory.stat names for v1's (bytes in both).
V2_NAMES = {"rss": "anon", "cache": "file", "mapped_file": "file_mapped", "shmem": "shmem"}
WHEN = ("ready", "workload")
CLONE_NEWNET = 0x40000000
CGROUP_ROOT = Path("/sys/fs/cgroup")
MEASURED = ("scripts/rekindle_dev/bench_density.py", "scripts/rekindle_dev/models.py")


def log(msg: str) -> None:
    print(f"[density {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- reading the kernel's numbers (pure where they can be) ----------------------------


def kb_fields(text: str) -> dict[str, int]:
    """The "Name: N kB" lines of /proc/meminfo or smaps_rollup, in kB."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            out[parts[0].rstrip(":")] = int(parts[1])
    return out


def pcp_free_pages(zoneinfo: str) -> int:
    """Free pages on the per-cpu lists (zoneinfo's "count:" lines).

    MemFree and MemAvailable leave them out, and a dying process's pages land there
    by the hundreds of MiB: the next restores take from them first, so "used" would
    grow less than what they took unless they are counted as free."""
    pages = 0
    for line in zoneinfo.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "count:":
            pages += int(parts[1])
    return pages


def node_memory(meminfo: str, zoneinfo: str, page_kb: int = 4) -> dict[str, int]:
    """The node's memory in kB: used = MemTotal - MemAvailable; used_pcp = the same with
    the per-cpu free lists counted as free; AnonPages, Cached, Shmem as the kernel says."""
    m = kb_fields(meminfo)
    m["pcp_free"] = pcp_free_pages(zoneinfo) * page_kb
    m["used"] = m["MemTotal"] - m["MemAvailable"]
    m["used_pcp"] = m["used"] - m["pcp_free"]
    return {k: m[k] for k in MEMINFO_KEYS}


def read_node_memory() -> dict[str, int]:
    return node_memory(
        Path("/proc/meminfo").read_text(),
        Path("/proc/zoneinfo").read_text(),
        os.sysconf("SC_PAGE_SIZE") // 1024,
    )


def memcg_numbers(stat: str, version: int, usage: int, peak: int) -> dict[str, int]:
    """A memory cgroup's charge in kB from its memory.stat text (bytes) and its usage and
    peak in bytes, under v1's names: rss (anonymous), cache (page cache, tmpfs included),
    mapped_file (of that cache, what is mapped), shmem (tmpfs, /dev/shm)."""
    fields: dict[str, int] = {}
    for line in stat.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            fields[parts[0]] = int(parts[1])
    names = V2_NAMES if version == 2 else {k: k for k in V2_NAMES}
    missing = [names[k] for k in V2_NAMES if names[k] not in fields]
    if missing:
        raise ValueError(f"memory.stat (cgroup v{version}) lacks {missing}")
    out = {k: fields[names[k]] // 1024 for k in V2_NAMES}
    out["usage"] = usage // 1024
    out["peak"] = peak // 1024
    return out


def sum_rollups(rollups: Sequence[dict[str, int]]) -> dict[str, int]:
    """The smaps_rollup fields summed over a tree's processes."""
    return {k: sum(r.get(k, 0) for r in rollups) for k in SMAPS_KEYS}


def rollup(pid: int) -> dict[str, int] | None:
    """/proc/PID/smaps_rollup's kB fields; None if the process is gone."""
    try:
        m = kb_fields(Path(f"/proc/{pid}/smaps_rollup").read_text())
    except (FileNotFoundError, ProcessLookupError):
        return None
    return {k: m.get(k, 0) for k in SMAPS_KEYS}


# -- the sandbox of one replica ------------------------------------------------------


@dataclasses.dataclass
class Memcg:
    """One memory cgroup made by this run (v1's memory hierarchy, or v2's)."""

    path: Path
    version: int

    @classmethod
    def make(cls, parent: Path, name: str, version: int) -> Memcg:
        path = parent / name
        path.mkdir()
        return cls(path, version)

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def pids(self) -> list[int]:
        return [int(x) for x in self.procs_file.read_text().split()]

    def numbers(self) -> dict[str, int]:
        if self.version == 1:
            usage = int((self.path / "memory.usage_in_bytes").read_text())
            peak = int((self.path / "memory.max_usage_in_bytes").read_text())
        else:
            usage = int((self.path / "memory.current").read_text())
            peak_file = self.path / "memory.peak"  # Linux 5.19 and later
            peak = int(peak_file.read_text()) if peak_file.exists() else usage
        return memcg_numbers((self.path / "memory.stat").read_text(), self.version, usage, peak)

    def remove(self, timeout: float = 60) -> None:
        """rmdir once every process left (the charge of its page cache stays where it
        is until reclaimed: an offline memcg keeps it)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if not self.pids():
                    self.path.rmdir()
                    return
            except FileNotFoundError:
                return
            except OSError:  # EBUSY while the last exiting task is being detached
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"memory cgroup {self.path} still busy after {timeout}s")
            time.sleep(0.05)


def memcg_root() -> tuple[Path, int]:
    """Where this run may make memory cgroups, and the cgroup version (fails, saying
    what is missing, on a node without a memory controller)."""
    v1 = CGROUP_ROOT / "memory"
    if (v1 / "memory.stat").exists():
        return v1, 1
    control = CGROUP_ROOT / "cgroup.subtree_control"
    if control.exists() and "memory" in control.read_text().split():
        return CGROUP_ROOT, 2
    raise RuntimeError(
        f"no memory cgroup controller: neither {v1} (v1) nor 'memory' in {control} (v2)"
    )


def replica_argv(
    agent: Sequence[str],
    procs_file: Path,
    replica_run: Path,
    run_dir: Path,
    cwd: Path,
    shm_size: str = "6g",
) -> list[str]:
    """The argv that runs one replica's agent in its sandbox: join the memory cgroup
    first (so every page the replica touches first is charged to it), then new network,
    PID and mount namespaces with loopback up, the replica's own run dir over the path
    the checkpoint names, and a private /dev/shm; the agent is exec'ed as PID 1 in cwd.

    cwd: the same for the agent that made the checkpoint and every replica (a restored
    tree keeps its working directory), and outside the checkout: `python -m` puts the
    working directory on sys.path, and the agent's fingerprint hashes the package
    metadata found there, which a `pip install` in the checkout rewrites."""
    inner = (
        'ip link set lo up && mount --bind "$1" "$2" && '
        f"mount -t tmpfs -o size={shm_size},mode=1777 shm /dev/shm && "
        'cd "$3" && shift 3 && exec "$@"'
    )
    return [
        "sh", "-c", 'echo $$ > "$1" && shift && exec "$@"', "sh", str(procs_file),
        "unshare", "--net", "--pid", "--fork", "--mount-proc", "--mount", "--",
        "sh", "-c", inner, "sh", str(replica_run), str(run_dir), str(cwd),
        *agent,
    ]  # fmt: skip


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


@contextlib.contextmanager
def in_netns(pid: int) -> Iterator[None]:
    """Run the block with this thread in PID's network namespace (sockets made inside
    stay there); the thread's own namespace is back afterwards. Per thread: other
    threads keep theirs."""
    target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(target)
        os.close(home)


@dataclasses.dataclass
class Replica:
    """One agent in its sandbox."""

    name: str
    agent: AgentProc
    memcg: Memcg
    run: Path

    def netns(self) -> contextlib.AbstractContextManager[None]:
        # The ports file is written from inside: the namespaces exist by then.
        self.agent.ports()
        return in_netns(self.agent.proc.pid)

    def measure(self) -> dict[str, Any]:
        """Every process charged to its memcg (the sandbox's wrapper, the agent, vLLM's
        tree): smaps_rollup each and summed, and the memcg's own numbers."""
        procs: list[dict[str, Any]] = []
        for pid in self.memcg.pids():
            r = rollup(pid)
            if r is None:
                continue
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                comm = "?"
            procs.append({"pid": pid, "comm": comm, "smaps_kb": r})
        return {
            "smaps_kb": sum_rollups([p["smaps_kb"] for p in procs]),
            "memcg_kb": self.memcg.numbers(),
            "processes": procs,
        }

    def stop(self) -> None:
        try:
            self.agent.stop()
        finally:
            self.memcg.remove()


def stop_all(reps: Sequence[Replica]) -> None:
    """Stop every replica (each is tried); the first failure is raised."""
    errors: list[Exception] = []
    for r in reps:
        try:
            r.stop()
        except Exception as e:
            errors.append(e)
    if errors:
        raise errors[0]


def launch(factory: AgentFactory, name: str, memcg: Memcg, work: Path, **overrides: Any) -> Replica:
    """Start one agent (settings: factory.args(**overrides)) in a fresh sandbox."""
    run = work / "replicas" / name
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True, mode=0o700)
    ports_file = work / "replicas" / f"{name}.ports.json"
    args = factory.args(ports_file=str(ports_file), **overrides)
    argv = replica_argv(
        agent_argv(args, AGENT_COMMAND), memcg.procs_file, run, factory.run_dir, work
    )
    proc = AgentProc(
        argv, work / "replicas" / f"{name}.log", ports_file, factory.token, factory.env
    )
    proc.vllm_port = None  # its port is in its own network namespace: nothing to wait for here
    return Replica(name, proc, memcg, run)


def answers(rep: Replica, prompts: Sequence[str], max_tokens: int) -> list[str]:
    with rep.netns():
        return [rep.agent.complete(p, max_tokens=max_tokens) for p in prompts]


def workload(
    reps: Sequence[Replica], prompts: Sequence[str], max_tokens: int, oracle: Sequence[str]
) -> list[float]:
    """Every replica answers the prompts at the same time (a thread each, in its own
    network namespace); each answer must equal the booted server's. Seconds per replica."""
    got: dict[str, list[str]] = {}
    secs: dict[str, float] = {}
    errors: list[BaseException] = []

    def serve(rep: Replica) -> None:
        t0 = time.monotonic()
        try:
            got[rep.name] = answers(rep, prompts, max_tokens)
        except BaseException as e:
            errors.append(e)
        secs[rep.name] = time.monotonic() - t0

    threads = [threading.Thread(target=serve, args=(r,)) for r in reps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"workload failed: {errors[0]!r}") from errors[0]
    for rep in reps:
        if got[rep.name] != list(oracle):
            raise RuntimeError(
                f"{rep.name} answered {got[rep.name]!r}, the booted server {list(oracle)!r}"
            )
    return [secs[r.name] for r in reps]


# -- one group: N replicas of one mode at once ---------------------------------------


@dataclasses.dataclass
class Setup:
    factory: AgentFactory
    work: Path
    ckpt: Path
    criu: dict[str, Path]
    cg_parent: Path
    cg_version: int
    prompts: tuple[str, ...]
    max_tokens: int
    oracle: list[str]


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def warm_checkpoint(ckpt: Path) -> None:
    """Read every file of the checkpoint once: its page cache is charged to this
    process's memory cgroup, not to any replica's."""
    for path in sorted(ckpt.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                while f.read(8 << 20):
                    pass


def checkpoint_residency(ckpt: Path) -> float | None:
    """Percent of the checkpoint in the page cache now (None, logged, if asking fails):
    proves a row's cold or warm label."""
    from rekindle_agent.restoring import residency

    try:
        return float(residency.residency(ckpt)["percent"])
    except (OSError, ValueError) as e:
        log(f"no residency for {ckpt}: {e}")
        return None


def one_group(s: Setup, n: int, mode: str, cache: str, tag: str) -> dict[str, Any]:
    """Restore n replicas at once in one mode; measure at Ready and after the workload."""
    if cache == "cold":
        drop_caches()
    else:
        warm_checkpoint(s.ckpt)
    resident = checkpoint_residency(s.ckpt)
    before = read_node_memory()
    reps: list[Replica] = []
    try:
        for i in range(n):
            name = f"{tag}-{mode}-n{n}-r{i}"
            memcg = Memcg.make(s.cg_parent, name, s.cg_version)
            try:
                reps.append(
                    launch(
                        s.factory,
                        name,
                        memcg,
                        s.work,
                        restore_from=str(s.ckpt),
                        restore_policy="require",
                        criu=str(s.criu[mode]),
                        **MODES[mode],
                    )
                )
            except BaseException:
                memcg.remove()
                raise
        ready_s = []
        for rep in reps:
            with rep.netns():
                st = rep.agent.wait_ready(600)
            if st.origin != "restored":
                raise RuntimeError(f"{rep.name} did not restore: {st.last_fallback}")
            if st.restored_with_mmap != (mode == "mmap"):
                raise RuntimeError(
                    f"{rep.name}: restored_with_mmap={st.restored_with_mmap} in mode {mode} "
                    f"({st.raw.get('restore_memory')})"
                )
            ready_s.append(st.start_to_ready_seconds() or 0.0)
        at_ready = read_node_memory()
        ready = [r.measure() for r in reps]
        work_s = workload(reps, s.prompts, s.max_tokens, s.oracle)
        after = read_node_memory()
        done = [r.measure() for r in reps]
    finally:
        stop_all(reps)
    return {
        "mode": mode,
        "cache": cache,
        "replicas": n,
        "residency_before_percent": resident,
        "ready_s": ready_s,
        "workload_s": work_s,
        "per_replica": [{"ready": a, "workload": b} for a, b in zip(ready, done, strict=True)],
        "meminfo_before_kb": before,
        "node_delta_kb": {
            "ready": {k: at_ready[k] - before[k] for k in MEMINFO_KEYS},
            "workload": {k: after[k] - before[k] for k in MEMINFO_KEYS},
        },
    }


# -- summaries, tables, plot (pure) ---------------------------------------------------


def stats(values: Sequence[float]) -> dict[str, Any]:
    """median, min, max and every value (one per trial)."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": list(values),
    }


def group_metrics(g: dict[str, Any], when: str) -> dict[str, float]:
    """One group's numbers at one moment: per replica (mean over the replicas), totals,
    the memcg's mean, min and max over the replicas, and the node's deltas."""
    reps = [r[when] for r in g["per_replica"]]
    out: dict[str, float] = {}
    for k in SMAPS_KEYS:
        vals = [r["smaps_kb"][k] for r in reps]
        out[f"pss_per_replica_{k}_kb"] = statistics.mean(vals)
        out[f"pss_total_{k}_kb"] = sum(vals)
    for k in MEMCG_KEYS:
        vals = [r["memcg_kb"][k] for r in reps]
        out[f"memcg_{k}_kb"] = statistics.mean(vals)
        out[f"memcg_{k}_kb_min"] = min(vals)
        out[f"memcg_{k}_kb_max"] = max(vals)
    for k in MEMINFO_KEYS:
        out[f"node_delta_{k}_kb"] = g["node_delta_kb"][when][k]
    return out


def summarize(groups: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per (cache, mode, N): medians over trials (min, max and per-trial values kept)."""
    out: dict[str, dict[str, Any]] = {}
    keys = sorted({(g["cache"], g["mode"], g["replicas"]) for g in groups})
    for cache, mode, n in keys:
        gs = [g for g in groups if (g["cache"], g["mode"], g["replicas"]) == (cache, mode, n)]
        row: dict[str, Any] = {"cache": cache, "mode": mode, "replicas": n, "trials": len(gs)}
        row["ready_s"] = stats([x for g in gs for x in g["ready_s"]])
        resident = [g["residency_before_percent"] for g in gs]
        if all(r is not None for r in resident):
            row["residency_before_percent"] = stats(resident)
        for when in WHEN:
            per = [group_metrics(g, when) for g in gs]
            row[when] = {k: stats([p[k] for p in per]) for k in per[0]}
        out[f"{cache}/{mode}/{n}"] = row
    for row in out.values():
        stock = out.get(f"{row['cache']}/stock/{row['replicas']}")
        if stock:
            for when in WHEN:
                base = stock[when]["pss_total_Pss_kb"]["median"]
                if base:
                    row[when]["pss_total_vs_stock"] = row[when]["pss_total_Pss_kb"]["median"] / base
    return out


def mib(kb: float | None) -> str:
    return "-" if kb is None else str(round(kb / 1024))  # round(): :.0f writes -0


def resident_cell(st: dict[str, Any] | None) -> str:
    if not st:
        return "not recorded"
    if st["min"] == st["max"]:
        return f"{st['median']:.1f}"
    return f"{st['median']:.1f} ({st['min']:.1f}-{st['max']:.1f})"


def table(summary: dict[str, dict[str, Any]], when: str) -> str:
    """One Markdown table of the summary at one moment (ready or workload)."""
    head = [
        "cache", "replicas", "restore", "checkpoint in page cache before (%)",
        "PSS per replica (MiB): anon + file + shmem",
        "PSS total (MiB)", "vs stock", "memcg per replica (MiB): rss + cache",
        "memcg mapped_file, shmem (MiB)", "memcg usage, min-max over replicas (MiB)",
        "memcg peak, max (MiB)", "node Δ used, pcp as free (MiB)", "node Δ AnonPages",
        "node Δ Cached", "node Δ Shmem",
    ]  # fmt: skip
    order = sorted(
        summary.values(), key=lambda r: (r["cache"], r["replicas"], r["mode"] != "stock")
    )
    rows = []
    for r in order:
        m = {k: v["median"] for k, v in r[when].items() if isinstance(v, dict)}
        vs = r[when].get("pss_total_vs_stock")
        rows.append([
            r["cache"], str(r["replicas"]), MODE_LABELS.get(r["mode"], r["mode"]),
            resident_cell(r.get("residency_before_percent")),
            f"{mib(m['pss_per_replica_Pss_kb'])}: {mib(m['pss_per_replica_Pss_Anon_kb'])} + "
            f"{mib(m['pss_per_replica_Pss_File_kb'])} + {mib(m['pss_per_replica_Pss_Shmem_kb'])}",
            mib(m["pss_total_Pss_kb"]), "-" if vs is None else f"{vs:.0%}",
            f"{mib(m['memcg_usage_kb'])}: {mib(m['memcg_rss_kb'])} + {mib(m['memcg_cache_kb'])}",
            f"{mib(m['memcg_mapped_file_kb'])}, {mib(m['memcg_shmem_kb'])}",
            f"{mib(m['memcg_usage_kb_min'])}-{mib(m['memcg_usage_kb_max'])}",
            mib(m["memcg_peak_kb_max"]), mib(m["node_delta_used_pcp_kb"]),
            mib(m["node_delta_AnonPages_kb"]), mib(m["node_delta_Cached_kb"]),
            mib(m["node_delta_Shmem_kb"]),
        ])  # fmt: skip
    return md_table(head, rows)


def boot_line(boot: dict[str, Any] | None) -> str:
    """The booted server (no restore), after the same workload: the reference."""
    if not boot:
        return ""
    s, c = boot["smaps_kb"], boot["memcg_kb"]
    return (
        f"For reference, the server that made the checkpoint (booted, no restore), after the "
        f"same workload: PSS {mib(s['Pss'])} MiB ({mib(s['Pss_Anon'])} anon + "
        f"{mib(s['Pss_File'])} file + {mib(s['Pss_Shmem'])} shmem); its memcg "
        f"{mib(c['usage'])} MiB ({mib(c['rss'])} rss + {mib(c['cache'])} cache), peak "
        f"{mib(c['peak'])} MiB.\n\n"
    )


def markdown(doc: dict[str, Any]) -> str:
    summary, meta, host = doc["summary"], doc["meta"], doc.get("host", {})
    load = host.get("load_avg_at_start"), host.get("load_avg_at_end")
    return (
        "# Density: N vLLM replicas restored from one checkpoint, stock CRIU vs "
        "`--mmap-restore`\n\n"
        f"The tiny model; one checkpoint of {meta['checkpoint_bytes'] / 2**30:.2f} GiB on this "
        "node; N replicas restored at the same time by the real agent, each in its own memory "
        "cgroup and network, PID and mount namespaces with a private /dev/shm. Median of "
        f"{meta['trials']} interleaved trials (per-trial values in results.json). Workload: "
        f"every replica answers {len(meta['prompts'])} different prompts, {meta['max_tokens']} "
        "tokens each, greedy, one after another (the replicas at the same time); every answer "
        'equalled the booted server\'s. "cold": page cache dropped before the restores (the '
        'replicas\' reads are charged to them); "warm": the checkpoint read first by the '
        "bench itself (charged to the bench's cgroup, not to a replica).\n\n"
        "- *PSS*: smaps_rollup summed over every process of a replica (its agent and vLLM's "
        "API server, engine core and worker); shared page cache is split among the "
        "processes mapping it. *vs stock*: PSS total against stock CRIU's at the same N.\n"
        "- *memcg*: what each replica's memory cgroup is charged (memory.stat rss and cache, "
        "cache including mapped_file and the /dev/shm tmpfs, shmem): what a pod's memory "
        "limit sees. A page is charged to the cgroup that touched it first, so the checkpoint's "
        "page cache lands on whichever replica read it first (usage min-max shows the "
        "spread); *peak*: the largest memory.max_usage (v2: memory.peak) of the replicas.\n"
        "- *node Δ*: /proc/meminfo after minus before the restores, whole node (other work on "
        "the machine moves it too); *used* counts page cache as available and the per-cpu "
        "free lists as free.\n\n"
        "How page cache is charged and what to set as requests and limits: docs/memory.md.\n\n"
        "## After the workload\n\n"
        + table(summary, "workload")
        + "\n## Right after Ready\n\n"
        + table(summary, "ready")
        + "\n"
        + boot_line(doc.get("boot"))
        + f"Machine: {host.get('node', '?')}, {host.get('cpu', '?')}, {host.get('cpus', '?')} "
        f"CPUs, {host.get('memory_gib', '?')} GiB, Linux {host.get('kernel', '?')}, "
        f"cgroup v{meta.get('cgroup_version', '?')}; checkpoint on {host.get('disk', '?')}. "
        f"Command: `{doc.get('command', '?')}`. Commit: {doc.get('commit') or 'unknown'}"
        f"{' (dirty)' if doc.get('dirty') else ''}. Date: {doc.get('date', '?')}. Load "
        f"average at start {fmt_load(load[0])}, at end {fmt_load(load[1])}.\n"
    )


def fmt_load(load: Sequence[float] | None) -> str:
    return "n/a" if not load else ", ".join(fmt(x, "{:.2f}") for x in load)


def plot(summary: dict[str, dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    caches = sorted({r["cache"] for r in summary.values()})
    ns = sorted({r["replicas"] for r in summary.values()})
    fig, axes = plt.subplots(len(caches), 2, figsize=(12, 4.5 * len(caches)), squeeze=False)
    width = 0.38
    parts = (("Pss_Anon", "anon"), ("Pss_File", "file"), ("Pss_Shmem", "shmem"))
    for row, cache in zip(axes, caches, strict=True):
        ax_pss, ax_cg = row
        for i, mode in enumerate(MODES):
            xs = [j + (i - 0.5) * width for j in range(len(ns))]
            rs = [summary.get(f"{cache}/{mode}/{n}") for n in ns]
            bottom = [0.0] * len(ns)
            for key, label in parts:
                ys = [r["workload"][f"pss_total_{key}_kb"]["median"] / 1024 if r else 0 for r in rs]
                ax_pss.bar(xs, ys, width, bottom=bottom, label=f"{mode}: {label}")
                bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
            med = [r["workload"]["memcg_usage_kb"]["median"] / 1024 if r else 0 for r in rs]
            lo = [r["workload"]["memcg_usage_kb_min"]["median"] / 1024 if r else 0 for r in rs]
            hi = [r["workload"]["memcg_usage_kb_max"]["median"] / 1024 if r else 0 for r in rs]
            err = [[m - low for m, low in zip(med, lo, strict=True)],
                   [h - m for m, h in zip(med, hi, strict=True)]]  # fmt: skip
            ax_cg.bar(xs, med, width, yerr=err, capsize=3, label=MODE_LABELS[mode].strip("`"))
        for ax, title in (
            (ax_pss, f"PSS of all replicas after the workload ({cache} cache)"),
            (ax_cg, f"memcg usage per replica, mean (min-max) ({cache} cache)"),
        ):
            ax.set_xticks(range(len(ns)), [f"{n} replica{'s' if n > 1 else ''}" for n in ns])
            ax.set_ylabel("MiB (median of trials)")
            ax.set_title(title, fontsize=10)
            ax.legend(fontsize=7)
    save_figure(fig, path, "vLLM replicas restored from one checkpoint: stock CRIU vs mmap")


# -- the run ---------------------------------------------------------------------------


def command_line(args: argparse.Namespace) -> str:
    parts = ["rekindle-dev bench density", f"--criu-prefix {args.criu_prefix}"]
    parts += [f"--replicas {args.replicas}", f"--modes {args.modes}", f"--caches {args.caches}"]
    parts += [f"--trials {args.trials}", f"--prompts {args.prompts}"]
    parts += [f"--max-tokens {args.max_tokens}", f"--work {args.work}"]
    if args.model:
        parts.append(f"--model {args.model}")
    return " ".join([*parts, f"--out {args.out}"])


def preflight(args: argparse.Namespace) -> list[str]:
    """What this machine lacks for the bench, each said so a user can fix it."""
    problems = []
    if os.geteuid() != 0:
        problems.append("needs root (CRIU, namespaces, cgroups, drop_caches)")
    if not args.criu_prefix:
        problems.append("--criu-prefix is required: pass scripts/build-criu's output")
    else:
        for flavor in ("stock", "patched"):
            p = Path(args.criu_prefix) / flavor / "criu"
            if not os.access(p, os.X_OK):
                problems.append(f"no CRIU at {p}: run scripts/build-criu and pass its output")
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            problems.append(f"{tool} not found on PATH (iproute2 / util-linux)")
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        problems.append(f"--modes {unknown}: choose from {','.join(MODES)}")
    bad_cache = [c for c in args.caches.split(",") if c not in ("cold", "warm")]
    if bad_cache:
        problems.append(f"--caches {bad_cache}: cold and/or warm")
    if not 1 <= args.prompts <= len(PROMPTS):
        problems.append(f"--prompts must be 1-{len(PROMPTS)}")
    return problems


def make_checkpoint(s: Setup) -> tuple[Manifest, dict[str, Any]]:
    """Boot one agent in the same kind of sandbox, take the oracle answers and its memory
    after them, and checkpoint it into s.ckpt. (manifest, the booted server's measure)."""
    memcg = Memcg.make(s.cg_parent, "boot", s.cg_version)
    rep = launch(s.factory, "boot", memcg, s.work)
    try:
        with rep.netns():
            rep.agent.wait_ready(900)
        s.oracle[:] = answers(rep, s.prompts, s.max_tokens)
        measured = rep.measure()
        with rep.netns():
            man = rep.agent.client.checkpoint(str(s.ckpt), timeout=900)
    finally:
        rep.stop()
    return man, measured


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.replot:
        saved = json.loads((out / "results.json").read_text())
        (out / "results.md").write_text(markdown(saved))
        plot(saved["summary"], out / "results.png")
        return 0
    problems = preflight(args)
    try:
        cg_base, cg_version = memcg_root()
    except RuntimeError as e:
        problems.append(str(e))
    if problems:
        for p in problems:
            print(f"rekindle-dev bench density: {p}", file=sys.stderr)
        return 2
    started, load_start = time.time(), os.getloadavg()
    prefix = Path(args.criu_prefix)
    criu = {"stock": prefix / "stock" / "criu", "mmap": prefix / "patched" / "criu"}
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    from rekindle_agent.mapped_files.immutable import remove_tree

    if args.model:
        model = Path(args.model)
    else:
        from rekindle_dev.models import generate_tiny_model

        model = generate_tiny_model(work / "tiny")
    factory = AgentFactory(work, model, criu["mmap"])
    factory.run_dir.mkdir(mode=0o700, exist_ok=True)  # the replicas' run dirs go over it
    cg_parent = cg_base / f"rekindle-density-{os.getpid()}"
    cg_parent.mkdir()
    if cg_version == 2:
        (cg_parent / "cgroup.subtree_control").write_text("+memory\n")
    s = Setup(
        factory=factory,
        work=work,
        ckpt=factory.checkpoints / f"density-{int(time.time())}",
        criu=criu,
        cg_parent=cg_parent,
        cg_version=cg_version,
        prompts=PROMPTS[: args.prompts],
        max_tokens=args.max_tokens,
        oracle=[],
    )
    groups: list[dict[str, Any]] = []
    try:
        log("booting once (in a sandbox like the replicas') to make the checkpoint")
        man, boot = make_checkpoint(s)
        size = sum(int(f["size"]) for f in man["files"])
        log(f"checkpoint {s.ckpt}: {size / 2**30:.2f} GiB; oracle {s.oracle!r}")
        counts = [int(x) for x in args.replicas.split(",")]
        modes = args.modes.split(",")
        for trial in range(args.trials):
            for cache in args.caches.split(","):
                for n in counts:
                    for mode in modes if trial % 2 == 0 else modes[::-1]:
                        g = one_group(s, n, mode, cache, f"t{trial}-{cache}")
                        g["trial"] = trial
                        groups.append(g)
                        per = [r["workload"]["smaps_kb"]["Pss"] for r in g["per_replica"]]
                        cg = [r["workload"]["memcg_kb"]["usage"] for r in g["per_replica"]]
                        log(
                            f"trial {trial} {cache} N={n} {mode}: PSS per replica "
                            f"{[mib(p) for p in per]} MiB, memcg {[mib(c) for c in cg]} MiB, "
                            f"node Δ used {mib(g['node_delta_kb']['workload']['used_pcp'])} "
                            f"MiB; load {os.getloadavg()[0]:.2f}"
                        )
    finally:
        with contextlib.suppress(OSError):
            cg_parent.rmdir()
        if s.ckpt.exists():
            remove_tree(s.ckpt)  # its images are immutable once proven: rm -rf cannot
        shutil.rmtree(work / "replicas", ignore_errors=True)
    doc: dict[str, Any] = {
        **provenance(command_line(args), MEASURED, load_start, started, str(work)),
        "meta": {
            "checkpoint_bytes": size,
            "checkpoint_timings": man.get("timings"),
            "trials": args.trials,
            "replicas": counts,
            "modes": {m: MODES[m] for m in modes},
            "caches": args.caches.split(","),
            "prompts": list(s.prompts),
            "max_tokens": args.max_tokens,
            "oracle": s.oracle,
            "cgroup_version": cg_version,
        },
        "boot": boot,
        "summary": summarize(groups),
        "groups": groups,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    text = markdown(doc)
    (out / "results.md").write_text(text)
    plot(doc["summary"], out / "results.png")
    print(text)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--criu-prefix", default="", help="scripts/build-criu's output directory")
    p.add_argument("--model", help="model directory (default: generate the tiny model)")
    p.add_argument("--replicas", default="1,2,4", help="replica counts, comma separated")
    p.add_argument("--modes", default="stock,mmap", help="stock (copying CRIU) and/or mmap")
    p.add_argument("--caches", default="cold", help="cold and/or warm (page cache before)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument(
        "--prompts", type=int, default=4, help=f"completions per replica (1-{len(PROMPTS)})"
    )
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per completion")
    p.add_argument("--work", default="/var/tmp/rekindle-density", help="scratch (on disk)")
    p.add_argument("--out", default="docs/bench/density")
    p.add_argument("--replot", action="store_true", help="only redraw from OUT/results.json")
