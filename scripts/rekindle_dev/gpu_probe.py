"""What the GPU path does on a real driver: one bounded run on a lent GPU machine.

The lent machine has a GPU, PyTorch and root, but no vLLM, no cluster and no
network; this probe exercises the parts of the GPU path that need only a
driver, each on a real CUDA process (a PyTorch child holding a known tensor
and a matmul result, which it re-checks on request):

  facts    the driver's and GPUs' facts, as the preflight reads them
  driver   lock / checkpoint / restore / unlock through a cuda-checkpoint
           command line (cuda_checkpoint_cli.py; NVIDIA's binary is not
           there): per-action times, GPU memory released, the NVIDIA files
           left open once CUDA released the GPU (nvidia_fds), a restore with
           a device map onto the same GPU, a refused map, and the same
           actions in-process (what a persistent helper would save)
  nvml     the same scan with NVML initialised and never shut down (what
           PyTorch's NVML device count does) and with it shut down
  criu     the patched CRIU with its CUDA plugin: dump and mmap restore of
           the PyTorch child, which then re-checks its GPU tensor
  h2d      pinned and pageable host-to-device bandwidth (the reloader's
           ceiling on this node)

Each phase is bounded and recorded as it ends (gpu-probe.json under --out),
so a phase that fails or runs out of time still leaves the others' numbers.

On the GPU machine, with the repository's packages importable (docs/gpu.md):
  python3 -m rekindle_dev.gpu_probe --out DIR --criu-dir .device/criu
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rekindle_agent.checkpointing import criu, gpu_preflight
from rekindle_node import nvidia_fds

from rekindle_dev import cuda_checkpoint_cli
from rekindle_dev.cuda_checkpoint_cli import Driver

# What the numbers depend on (bench_provenance reads it): the driver-facing code the probe
# runs, not the whole agent (no vLLM, no restore flow runs here).
MEASURED_PATHS = (
    "criu-patches",
    "scripts/build-criu",
    "images/runtime/rekindle_agent/checkpointing/criu.py",
    "images/runtime/rekindle_agent/checkpointing/gpu_preflight.py",
    "images/runtime/rekindle_node/nvidia_fds.py",
    "scripts/rekindle_dev/gpu_probe.py",
    "scripts/rekindle_dev/cuda_checkpoint_cli.py",
)
CHILD_READY_S = 180.0
ACTION_TIMEOUT_S = 120.0
CLI = [sys.executable, cuda_checkpoint_cli.__file__]


# ------------------------------------------------------------------ the CUDA child


def child(mode: str, gib: float, ctl: Path) -> None:
    """A CUDA process with known GPU state; re-checks it each time ctl/go-N appears."""
    import torch

    on = "cpu" if mode == "cpu" else "cuda"  # cpu: the orchestration, tried without a GPU
    if on == "cuda":
        torch.cuda.init()
    count = torch.cuda.device_count()
    if mode.startswith("nvml"):
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()  # what torch's NVML-based device count does, and never undoes
        pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        if mode == "nvml-closed":
            pynvml.nvmlShutdown()
    numel = int(gib * (1 << 30)) // 4
    x = torch.arange(numel, dtype=torch.int32, device=on)
    g = torch.Generator(device=on).manual_seed(7)
    a = torch.randn(2048, 2048, device=on, generator=g)
    ref = float((a @ a).sum().item())
    want = int(x.sum(dtype=torch.int64).item())
    gpu = lambda: str(torch.cuda.get_device_properties(0).uuid) if on == "cuda" else "cpu"  # noqa: E731
    dev = gpu()
    (ctl / "ready.json").write_text(json.dumps({"pid": os.getpid(), "devices": count, "gpu": dev}))
    n = 0
    while True:
        n += 1
        go = ctl / f"go-{n}"
        while not go.exists():
            time.sleep(0.02)
        t = time.monotonic()
        got = int(x.sum(dtype=torch.int64).item())
        again = float((a @ a).sum().item())
        res = {
            "tensor_ok": got == want,
            "matmul_ok": again == ref,
            "gpu": gpu(),
            "check_s": round(time.monotonic() - t, 4),
        }
        (ctl / f"result-{n}.json").write_text(json.dumps(res))


class Child:
    """A started child and its control directory."""

    def __init__(self, work: Path, name: str, mode: str, gib: float) -> None:
        self.ctl = work / name
        shutil.rmtree(self.ctl, ignore_errors=True)
        self.ctl.mkdir(parents=True)
        self.log = open(self.ctl / "child.log", "ab")  # noqa: SIM115 (lives with the child)
        argv = [sys.executable, "-m", "rekindle_dev.gpu_probe", "child", mode, str(gib)]
        self.proc = subprocess.Popen(
            [*argv, str(self.ctl)],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pid = self.proc.pid
        self.checks = 0
        ready = self._wait(self.ctl / "ready.json", CHILD_READY_S)
        self.gpu = "GPU-" + ready["gpu"]

    def _wait(self, path: Path, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return dict(json.loads(path.read_text()))
            if self.proc.poll() is not None and not path.exists():
                raise RuntimeError(f"child exited: {self.tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"{path.name} not written in {timeout} s: {self.tail()}")

    def check(self, timeout: float = 60.0) -> dict[str, Any]:
        """Ask the child to re-check its GPU state; its answer."""
        self.checks += 1
        (self.ctl / f"go-{self.checks}").write_text("")
        deadline = time.monotonic() + timeout
        out = self.ctl / f"result-{self.checks}.json"
        while time.monotonic() < deadline:
            if out.exists():
                return dict(json.loads(out.read_text()))
            time.sleep(0.05)
        raise TimeoutError(f"no answer to check {self.checks}: {self.tail()}")

    def tail(self) -> str:
        return (self.ctl / "child.log").read_text(errors="replace")[-3000:]

    def kill(self) -> None:
        """SIGKILL by PID: after a CRIU restore that PID is the restored process."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.log.close()


# ------------------------------------------------------------------ helpers


def cli(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One cuda-checkpoint command line, as CRIU's plugin runs it: rc, output, seconds."""
    t = time.monotonic()
    p = subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=ACTION_TIMEOUT_S, env=env
    )
    return {"rc": p.returncode, "out": (p.stdout + p.stderr).strip(), "s": secs(t)}


def secs(t0: float) -> float:
    return round(time.monotonic() - t0, 4)


def gpu_mib(pid: int) -> int | None:
    """GPU memory (MiB) nvidia-smi charges to pid; None when it lists none."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    for row in out.splitlines():
        fields = [f.strip() for f in row.split(",")]
        if len(fields) == 2 and fields[0] == str(pid):
            return int(fields[1])
    return None


def rss_mib(pid: int) -> float | None:
    """The process's resident host memory (VmRSS), MiB: where the driver's checkpoint
    action puts the GPU memory it saves."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def handles(pid: int) -> list[str]:
    return [str(h) for h in nvidia_fds.scan(pid)]


# ------------------------------------------------------------------ phases


def phase_facts(_: argparse.Namespace, work: Path) -> dict[str, Any]:
    smi = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=name,uuid,driver_version,memory.total,persistence_mode,pci.bus_id",
            "--format=csv,noheader",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    gpus = gpu_preflight.node_gpus()
    return {
        "nvidia_smi": smi.stdout.strip() or smi.stderr.strip(),
        "driver_version": gpu_preflight.driver_version(),
        "node_gpus": gpus,
        "device_minors": gpu_preflight.device_minors(),
        "mig_enabled": gpu_preflight.mig_enabled(uuids=list(gpus)),
        "dev_nvidia": sorted(p.name for p in Path("/dev").glob("nvidia*")),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "driver_uuids": Driver().gpu_uuids(),
    }


def phase_driver(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    c = Child(work, "driver", "torch", a.gib)
    pid = str(c.pid)
    r: dict[str, Any] = {"gib": a.gib, "pid": c.pid, "gpu": c.gpu}
    try:
        r["gpu_mib_before"] = gpu_mib(c.pid)
        r["handles_running"] = handles(c.pid)
        cycles = []
        for name, dmap in (("identity-map", f"{c.gpu}={c.gpu}"), ("no-map", "")):
            cyc: dict[str, Any] = {"name": name, "rss_mib_running": rss_mib(c.pid)}
            cyc["lock"] = cli("--action", "lock", "--pid", pid, "--timeout", "10000")
            cyc["checkpoint"] = cli("--action", "checkpoint", "--pid", pid)
            cyc["rss_mib_checkpointed"] = rss_mib(c.pid)
            cyc["state"] = cli("--get-state", "--pid", pid)["out"]
            cyc["restore_tid"] = cli("--get-restore-tid", "--pid", pid)["out"]
            cyc["gpu_mib_checkpointed"] = gpu_mib(c.pid)
            cyc["handles_checkpointed"] = handles(c.pid)
            if name == "no-map":  # a map naming a GPU the process never used is refused
                wrong = "GPU-" + str(uuid.uuid4())
                cyc["restore_wrong_map"] = cli(
                    "--action", "restore", "--pid", pid, "--device-map", f"{wrong}={c.gpu}"
                )
            extra = ["--device-map", dmap] if dmap else []
            cyc["restore"] = cli("--action", "restore", "--pid", pid, *extra)
            cyc["unlock"] = cli("--action", "unlock", "--pid", pid)
            cyc["state_after"] = cli("--get-state", "--pid", pid)["out"]
            cyc["check"] = c.check()
            cycles.append(cyc)
        r["cycles"] = cycles
        drv = Driver()  # in-process: no interpreter or driver start-up per action
        inproc: dict[str, float] = {}
        for step, fn in (
            ("lock", lambda: drv.lock(c.pid, 10000)),
            ("checkpoint", lambda: drv.checkpoint(c.pid)),
            ("restore", lambda: drv.restore(c.pid)),
            ("unlock", lambda: drv.unlock(c.pid)),
        ):
            t = time.monotonic()
            fn()
            inproc[step] = secs(t)
        r["in_process"] = inproc
        r["in_process_check"] = c.check()
    finally:
        c.kill()
    return r


def phase_nvml(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("nvml", "nvml-closed"):
        c = Child(work, mode, mode, 0.25)
        pid = str(c.pid)
        try:
            r: dict[str, Any] = {"handles_running": handles(c.pid)}
            r["lock"] = cli("--action", "lock", "--pid", pid, "--timeout", "10000")
            r["checkpoint"] = cli("--action", "checkpoint", "--pid", pid)
            left = nvidia_fds.scan(c.pid)
            r["handles_checkpointed"] = [str(h) for h in left]
            r["message"] = nvidia_fds.leftover_message(left) if left else ""
            r["restore"] = cli("--action", "restore", "--pid", pid)
            r["unlock"] = cli("--action", "unlock", "--pid", pid)
            r["check"] = c.check()
        finally:
            c.kill()
        out[mode] = r
    return out


class Criu:
    """The carried CRIU (criu, plugins/, lib/) with the cuda-checkpoint work-alike on PATH."""

    def __init__(self, criu_dir: str, work: Path) -> None:
        cdir = Path(criu_dir).resolve()
        self.binary, self.plugins = str(cdir / "criu"), str(cdir / "plugins")
        self.env = dict(os.environ, LD_LIBRARY_PATH=str(cdir / "lib"))
        shim = work / "bin"
        shim.mkdir(exist_ok=True)
        # The work-alike needs the standard library only: run as a script, by its path.
        (shim / "cuda-checkpoint").write_text(
            "#!/bin/sh\nunset LD_LIBRARY_PATH\n"
            f'exec {sys.executable} {cuda_checkpoint_cli.__file__} "$@"\n'
        )
        (shim / "cuda-checkpoint").chmod(0o755)
        self.env["PATH"] = f"{shim}:{self.env['PATH']}"

    def run(self, *args: str) -> str:
        p = subprocess.run(
            [self.binary, *args], capture_output=True, text=True, env=self.env, timeout=60
        )
        return (p.stdout + p.stderr).strip()[-2000:]

    def cycle(self, c: Child, restores: tuple[bool, ...]) -> dict[str, Any]:
        """Dump the child (CUDA plugin), then restore it: each of restores (mmap or not) is
        tried in turn until one works; the child re-checks its GPU state after it."""
        images = c.ctl / "images"
        images.mkdir()
        one: dict[str, Any] = {"pid": c.pid}
        t = time.monotonic()
        log = str(c.ctl / "dump.log")
        argv = criu.dump_argv(self.binary, c.pid, str(images), log, plugins=self.plugins)
        p = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=300)
        one["dump"] = {"rc": p.returncode, "s": secs(t)}
        one["dump_log_tail"] = criu.log_tail(Path(log).read_text(errors="replace"), 25)
        one["images_mib"] = round(sum(f.stat().st_size for f in images.iterdir()) / 2**20, 1)
        if p.returncode != 0:
            one["child_after_failed_dump"] = c.check() if c.proc.poll() is None else "dead"
            return one
        c.proc.wait(timeout=30)  # reap it: the restore needs its PID free
        for mmap in restores:
            t = time.monotonic()
            tag = "mmap" if mmap else "copy"
            rlog, pidfile = str(c.ctl / f"restore-{tag}.log"), str(c.ctl / f"{tag}.pid")
            argv = criu.restore_argv(
                self.binary, str(images), rlog, pidfile, mmap=mmap, plugins=self.plugins
            )
            p = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=300)
            log_text = Path(rlog).read_text(errors="replace")
            one[f"restore_{tag}"] = {
                "rc": p.returncode,
                "s": secs(t),
                "log_tail": criu.log_tail(log_text, 25),
            }
            if p.returncode == 0:
                one["check"] = c.check()
                one["restored_pid"] = int(Path(pidfile).read_text())
                one["handles_restored"] = handles(one["restored_pid"])
                one["gpu_mib_restored"] = gpu_mib(one["restored_pid"])
                break
        return one


def phase_criu(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    cr = Criu(a.criu_dir, work)
    r: dict[str, Any] = {"criu_check": cr.run("check"), "criu_version": cr.run("--version")}
    cases = [("torch", "torch"), ("nvml-left-open", "nvml")]
    if a.child == "cpu":
        cases = [("cpu", "cpu")]
    for name, mode in cases:
        c = Child(work, f"criu-{name}", mode, a.gib_criu)
        try:
            r[name] = cr.cycle(c, (True, False))  # the mapped restore first; a copy if it fails
        finally:
            c.kill()
    return r


def phase_criu_trials(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Dump and restore times of the two restore arms, interleaved, on fresh children.

    Both arms restore images CRIU has just written (in the page cache: warm for both)."""
    cr = Criu(a.criu_dir, work)
    mode = "cpu" if a.child == "cpu" else "torch"
    arms: dict[str, list[dict[str, Any]]] = {"mmap": [], "copy": []}
    for trial in range(a.trials):
        order = ("mmap", "copy") if trial % 2 == 0 else ("copy", "mmap")
        for arm in order:
            c = Child(work, f"trial-{trial}-{arm}", mode, a.gib_criu)
            try:
                one = cr.cycle(c, (arm == "mmap",))
            finally:
                c.kill()
            restore = one.get(f"restore_{arm}", {})
            arms[arm].append(
                {
                    "dump_s": one["dump"]["s"],
                    "restore_s": restore.get("s"),
                    "ok": restore.get("rc") == 0 and one.get("check", {}).get("tensor_ok") is True,
                    "images_mib": one["images_mib"],
                }
            )
    out: dict[str, Any] = {"gib": a.gib_criu, "trials": arms}
    for arm, rows in arms.items():
        times = [row["restore_s"] for row in rows if row["ok"]]
        out[f"{arm}_restore_median_s"] = statistics.median(times) if times else None
        out[f"{arm}_dump_median_s"] = statistics.median(row["dump_s"] for row in rows)
    return out


def phase_criu_map(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """criu-patches/0007 on a real restore, through the agent's own env argv: a map naming
    a GPU the process never used, then a map onto its own GPU, from the same images. What
    a failed CUDA restore leaves behind (CRIU's exit status, the driver's state, whether
    the process answers) is recorded, not assumed."""
    cr = Criu(a.criu_dir, work)
    mode = "cpu" if a.child == "cpu" else "torch"
    c = Child(work, "criu-map", mode, a.gib_criu)
    gpu = c.gpu if mode == "torch" else "GPU-" + str(uuid.uuid4())
    wrong = "GPU-" + str(uuid.uuid4())
    images = c.ctl / "images"
    images.mkdir()
    shim_cc = str(work / "bin" / "cuda-checkpoint")
    r: dict[str, Any] = {"gpu": gpu}
    try:
        log = str(c.ctl / "dump.log")
        argv = criu.dump_argv(cr.binary, c.pid, str(images), log, plugins=cr.plugins)
        p = subprocess.run(argv, capture_output=True, text=True, env=cr.env, timeout=300)
        r["dump_rc"] = p.returncode
        if p.returncode != 0:
            r["dump_log_tail"] = criu.log_tail(Path(log).read_text(errors="replace"), 25)
            return r
        c.proc.wait(timeout=30)
        for tag, gpu_map in (("wrong_map", f"{wrong}={gpu}"), ("same_gpu_map", f"{gpu}={gpu}")):
            for f in [*c.ctl.glob("go-*"), *c.ctl.glob("result-*")]:
                f.unlink()
            c.checks = 0
            rlog, pidfile = str(c.ctl / f"restore-{tag}.log"), str(c.ctl / f"{tag}.pid")
            argv = criu.restore_argv(
                cr.binary, str(images), rlog, pidfile, mmap=True, plugins=cr.plugins
            )
            argv = gpu_preflight.criu_env_argv(argv, shim_cc, cr.env["PATH"], gpu_map)
            t = time.monotonic()
            p = subprocess.run(argv, capture_output=True, text=True, env=cr.env, timeout=300)
            text = Path(rlog).read_text(errors="replace")
            one: dict[str, Any] = {
                "map": gpu_map,
                "rc": p.returncode,
                "s": secs(t),
                "map_logged": f"with device map {gpu_map}" in text,
                "log_tail": criu.log_tail(text, 25),
            }
            r[tag] = one
            if p.returncode != 0:
                continue
            pid = int(Path(pidfile).read_text())
            one["state"] = cli("--get-state", "--pid", str(pid))
            try:
                one["check"] = c.check(timeout=20)
            except TimeoutError as e:
                one["check"] = f"no answer: {str(e)[:300]}"
            if isinstance(one["check"], dict) and one["check"].get("tensor_ok"):
                break
            with contextlib.suppress(ProcessLookupError):  # broken: free its PID, go on
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        c.kill()
    return r


def phase_criu_stopped(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Does CRIU 4.2.1's CUDA plugin hang a restore with --leave-stopped on a real GPU, as
    it does with CRIU's mock (tests/criu/test_cuda_plugin.py)? Bounded: a CRIU still
    running after stopped_timeout_s is killed, and so is what it restored."""
    cr = Criu(a.criu_dir, work)
    mode = "cpu" if a.child == "cpu" else "torch"
    c = Child(work, "criu-stopped", mode, a.gib_criu)
    images = c.ctl / "images"
    images.mkdir()
    r: dict[str, Any] = {"timeout_s": a.stopped_timeout_s}
    try:
        log = str(c.ctl / "dump.log")
        argv = criu.dump_argv(cr.binary, c.pid, str(images), log, plugins=cr.plugins)
        r["dump_rc"] = subprocess.run(argv, env=cr.env, capture_output=True, timeout=300).returncode
        if r["dump_rc"] != 0:
            return r
        c.proc.wait(timeout=30)
        rlog, pidfile = str(c.ctl / "restore-stopped.log"), str(c.ctl / "stopped.pid")
        argv = criu.restore_argv(
            cr.binary, str(images), rlog, pidfile, mmap=True, plugins=cr.plugins, stopped=True
        )
        t = time.monotonic()
        try:
            p = subprocess.run(argv, env=cr.env, capture_output=True, timeout=a.stopped_timeout_s)
            r["rc"], r["hung"] = p.returncode, False
        except subprocess.TimeoutExpired:
            r["hung"] = True
        r["s"] = secs(t)
        r["log_tail"] = criu.log_tail(Path(rlog).read_text(errors="replace"), 15)
        if not r["hung"] and r.get("rc") == 0:
            os.kill(c.pid, signal.SIGCONT)
            r["check"] = c.check(timeout=30)
    finally:
        c.kill()
    return r


def phase_h2d(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    n = 1 << 30
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {"bytes": n}
    for name, pin in (("pinned", True), ("pageable", False)):
        host = torch.ones(n, dtype=torch.uint8, pin_memory=pin)
        trials = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dev.copy_(host, non_blocking=pin)
            torch.cuda.synchronize()
            trials.append(round(n / (time.perf_counter() - t) / 1e9, 2))
        out[name] = {"gb_per_s": trials, "median": statistics.median(trials)}
    return out


PHASES: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "facts": phase_facts,
    "driver": phase_driver,
    "nvml": phase_nvml,
    "criu": phase_criu,
    "criu_trials": phase_criu_trials,
    "criu_map": phase_criu_map,
    "criu_stopped": phase_criu_stopped,
    "h2d": phase_h2d,
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "child":
        child(args[1], float(args[2]), Path(args[3]))
        return 0
    p = argparse.ArgumentParser(prog="gpu_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where gpu-probe.json and the logs go")
    p.add_argument("--work", default="/tmp/rekindle-gpu-probe", help="children, CRIU images")
    p.add_argument("--criu-dir", default=".device/criu", help="criu, plugins/, lib/")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--gib", type=float, default=4.0, help="GPU tensor of the driver phase")
    p.add_argument("--gib-criu", type=float, default=1.0, help="GPU tensor of the CRIU phase")
    p.add_argument("--stopped-timeout-s", type=float, default=60.0, help="criu_stopped's bound")
    p.add_argument("--trials", type=int, default=3, help="trials per arm of criu_trials")
    p.add_argument("--child", default="torch", help="cpu: try the CRIU phase without a GPU")
    p.add_argument("--budget-s", type=float, default=420.0, help="no phase starts after this")
    a = p.parse_args(args)
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # The machine gets a copy of the tree without .git: the caller names the commit.
        "commit": os.environ.get("REKINDLE_COMMIT", ""),
        "measured_paths": list(MEASURED_PATHS),
        "command": " ".join(["python3 -m rekindle_dev.gpu_probe", *args]),
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, kernel {platform.release()}",
        "load_before": os.getloadavg(),
    }
    for name in a.phases.split(","):
        if time.monotonic() - t0 > a.budget_s:
            results[name] = {"skipped": f"past the {a.budget_s} s budget"}
            continue
        t = time.monotonic()
        print(f"[probe] {name} ...", flush=True)
        try:
            results[name] = PHASES[name](a, work)
        except Exception as e:  # a phase's failure is a result; the next phase still runs
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        results[name]["phase_s"] = secs(t)
        (out / "gpu-probe.json").write_text(json.dumps(results, indent=1))
        print(f"[probe] {name}: {json.dumps(results[name])[:1500]}", flush=True)
    # Again at the end: phases skipped for the budget are results too.
    (out / "gpu-probe.json").write_text(json.dumps(results, indent=1))
    logs = work / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    for log in list(work.rglob("*.log")):
        (logs / log.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, logs / log.parent.name / log.name)
    shutil.make_archive(str(out / "gpu-probe-logs"), "gztar", logs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
