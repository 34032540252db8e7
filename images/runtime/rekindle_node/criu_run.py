"""Run the node agent's own CRIU inside a pod's pid and mount namespaces.

CRIU must run in the pod's pid namespace (a restore recreates the tree's pids
there, reparented to the pod's PID 1) and mount namespace (the tree's files,
/dev/shm and /proc are the pod's). `nsenter -t <pod PID 1> -p -m` gets it
there, but then every path is the pod's: a `criu` found by path would be the
tenant image's binary, run as root with every capability. So nothing is looked
up by path inside the pod. The node agent opens its own dynamic loader, its
library directory and its CRIU binary before entering, and the command is
`/proc/self/fd/<loader> --library-path /proc/self/fd/<libs> /proc/self/fd/<criu>`:
magic links to files of the node agent's image, valid in any mount namespace.
Image and work directories are passed the same way (`-D /proc/self/fd/<dir>`),
so a dump is written to, and a restore reads from, node-private storage the pod
cannot see.
"""

from __future__ import annotations

import os
import subprocess
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

LOADER = Path("/lib64/ld-linux-x86-64.so.2")
PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
LIBDIR = Path("/lib/x86_64-linux-gnu")


@dataclass(frozen=True)
class CriuFiles:
    """The node agent's CRIU and what it needs to run, in the node agent's filesystem."""

    criu: Path
    loader: Path = LOADER
    libdir: Path = LIBDIR
    plugins: Path | None = None  # CRIU's plugin directory (-L), e.g. the CUDA plugin


@dataclass
class Descriptors:
    """Descriptors opened in the node agent, to be named as /proc/self/fd/N in the pod."""

    stack: ExitStack = field(default_factory=ExitStack)
    fds: list[int] = field(default_factory=list)

    def open(self, path: Path, directory: bool = False) -> str:
        flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0)
        fd = os.open(path, flags)
        self.stack.callback(os.close, fd)
        self.fds.append(fd)
        return f"/proc/self/fd/{fd}"

    def close(self) -> None:
        self.stack.close()


@dataclass(frozen=True)
class CriuResult:
    returncode: int
    output: str


def criu_prefix(files: CriuFiles, fds: Descriptors) -> list[str]:
    """argv that runs the node agent's CRIU from descriptors (no path looked up in the pod)."""
    return [
        fds.open(files.loader),
        "--library-path",
        fds.open(files.libdir, directory=True),
        fds.open(files.criu),
    ]


def in_pod(pod_init: int, argv: list[str]) -> list[str]:
    """argv run in the pod's namespaces (those of its PID 1, pod_init): pid and mount,
    and network, IPC and UTS, so that CRIU sees the tree's namespaces as its own and
    dumps none of them."""
    return ["nsenter", "-t", str(pod_init), "-p", "-m", "-n", "-i", "-u", "--", *argv]


def criu_argv(
    files: CriuFiles,
    fds: Descriptors,
    pod_init: int,
    action: list[str],
    images: Path,
    work: Path,
    log: str,
    extra: list[str],
) -> list[str]:
    """`criu ACTION` in the pod: images written (dump) or read (restore, read-only and
    verified) through a descriptor; its log goes to work, so images hold only images."""
    args = [*action, "-D", fds.open(images, directory=True)]
    args += ["-W", fds.open(work, directory=True), "-o", log, "-v4", *extra]
    if files.plugins is not None:
        args += ["-L", fds.open(files.plugins, directory=True)]
    return in_pod(pod_init, [*criu_prefix(files, fds), *args])


def cgroup_procs(pod_init: int, proc: Path = PROC, root: Path = CGROUP_ROOT) -> list[Path]:
    """The cgroup.procs files of pod_init's cgroups, one per hierarchy (v1) or the one (v2)."""
    out = []
    for line in (proc / str(pod_init) / "cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        if controllers == "":
            # The unified hierarchy: the root on cgroup v2, unified/ beside v1 (hybrid).
            base = root if (root / "cgroup.controllers").is_file() else root / "unified"
        else:
            name = controllers.removeprefix("name=")
            base = root / name
        if not base.is_dir():
            continue  # a named hierarchy this node does not mount (or a test's)
        procs = base / path.lstrip("/") / "cgroup.procs"
        if procs.is_file():
            out.append(procs)
    if not out:
        raise FileNotFoundError(
            f"none of the cgroups of the pod's PID 1 ({pod_init}) is under {root}: mount the "
            "node's /sys/fs/cgroup there (a container sees only its own cgroups at "
            "/sys/fs/cgroup) and pass it as --cgroup-root"
        )
    return out


def join_cgroups(procs: list[Path]) -> None:
    """Move the calling process into those cgroups (runs in the child before exec)."""
    pid = str(os.getpid()).encode()
    for p in procs:
        fd = os.open(p, os.O_WRONLY)
        try:
            os.write(fd, pid)
        finally:
            os.close(fd)


def run(
    argv: list[str], fds: Descriptors, timeout: float, cgroups: list[Path] | None = None
) -> CriuResult:
    """Run argv with exactly fds inherited; stdin is /dev/null (CRIU must not hold ours).

    cgroups: CRIU (and so the tree it restores) joins them before it starts, so a
    restored tree is charged to, and limited as, the pod it runs in.
    """
    try:
        out = subprocess.run(
            argv,
            pass_fds=tuple(fds.fds),
            preexec_fn=(lambda: join_cgroups(cgroups)) if cgroups else None,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )
    finally:
        fds.close()
    return CriuResult(returncode=out.returncode, output=out.stdout)


def _run_in_pod(
    files: CriuFiles,
    pod_init: int,
    action: list[str],
    images: Path,
    work: Path,
    log: str,
    extra: list[str],
    timeout: float,
    cgroup_root: Path,
) -> CriuResult:
    cgroups = cgroup_procs(pod_init, root=cgroup_root)
    fds = Descriptors()
    argv = criu_argv(files, fds, pod_init, action, images, work, log, extra)
    return run(argv, fds, timeout, cgroups)


def dump(
    files: CriuFiles,
    pod_init: int,
    pid_in_pod: int,
    images: Path,
    work: Path,
    extra: list[str],
    timeout: float = 600.0,
    cgroup_root: Path = CGROUP_ROOT,
) -> CriuResult:
    """`criu dump` of the tree rooted at pid_in_pod (its pid inside the pod) into images."""
    action = ["dump", "-t", str(pid_in_pod)]
    return _run_in_pod(
        files, pod_init, action, images, work, "dump.log", extra, timeout, cgroup_root
    )


def restore(
    files: CriuFiles,
    pod_init: int,
    images: Path,
    work: Path,
    extra: list[str],
    timeout: float = 600.0,
    cgroup_root: Path = CGROUP_ROOT,
) -> CriuResult:
    """`criu restore -d` of images into the pod (the tree re-parented to its PID 1)."""
    action = ["restore", "-d"]
    return _run_in_pod(
        files, pod_init, action, images, work, "restore.log", extra, timeout, cgroup_root
    )
