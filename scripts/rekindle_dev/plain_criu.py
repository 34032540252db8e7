"""The simplest alternative a user could script: stock CRIU over the whole vLLM server.

Rekindle's restore is more than CRIU: vLLM sleeps before the dump (weights and
KV cache leave the image), the weights come back from a flat dump, CRIU maps
its images instead of copying them, and the agent checks every byte. To show
what each of those buys, `bench local` also times the plain way, which needs
none of Rekindle:

  boot    vLLM's OpenAI server in a fresh PID + mount namespace with its own
          /dev/shm tmpfs (as in a pod), the same vLLM argv and environment the
          agent uses, under the same io_uring seccomp filter (CRIU cannot dump
          io_uring; a user would need this filter or the host sysctl), with
          the namespace's next PIDs pushed up (ns_last_pid) so a restore's own
          helpers cannot take them;
  dump    stock CRIU dumps the whole tree, weights and KV cache included, with
          the agent's flags; then /dev/shm is copied beside the images;
  restore a fresh namespace: /dev/shm copied back, `criu restore -d` (stock,
          copying), and the restored server answers on its old port.

No sleep, no weight reload, no patch, no check of the images: the baseline
Rekindle must beat by more than its own extra work costs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rekindle_agent.checkpointing.criu import COMMON_FLAGS
from rekindle_agent.confinement import seccomp
from rekindle_agent.supervision.vllm_launch import vllm_env
from rekindle_agent.supervision.vllm_process import wait_port_free
from rekindle_contract.vllm_argv import VllmOptions, vllm_argv

# vLLM's tree gets PIDs above this in its namespace (the agent's --ns-last-pid default).
PID_FLOOR = 10000
SHM_SIZE = "6g"
# PID 1 of the boot namespace: a /dev/shm of its own, PIDs pushed up, vLLM as its child in
# a session of its own (CRIU refuses a tree whose session leader is outside its namespace),
# then it stays (sleep) so the namespace and its /dev/shm outlive vLLM's dump. vLLM's
# stdio is opened here, inside the namespace ($1: its log): CRIU cannot dump a descriptor
# opened in another mount namespace.
BOOT_INIT = f"""
mount -t tmpfs -o size={SHM_SIZE},mode=1777 shm /dev/shm || exit 1
echo {PID_FLOOR} > /proc/sys/kernel/ns_last_pid || exit 1
log=$1
shift
setsid "$@" </dev/null >"$log" 2>&1 &
exec sleep infinity
"""
# PID 1 of a restore's namespace: /dev/shm back ($1), vLLM's log as it was at the dump ($2
# copied over $3: CRIU checks an open file's size), then CRIU; it stays as the tree's parent.
RESTORE_INIT = f"""
mount -t tmpfs -o size={SHM_SIZE},mode=1777 shm /dev/shm || exit 1
cp -a --sparse=always "$1/." /dev/shm/ || exit 1
cp "$2" "$3" || exit 1
shift 3
"$@" || exit 1
exec sleep infinity
"""
UNSHARE = ("unshare", "--pid", "--fork", "--mount-proc", "--mount", "--")


@dataclass(frozen=True)
class PlainImage:
    """One whole-server dump: CRIU's images and the /dev/shm files beside them."""

    images: Path
    shm: Path
    log: Path  # vLLM's log, which the tree keeps open: restored to saved_log before CRIU
    saved_log: Path
    port: int
    served_name: str

    def paths(self) -> list[Path]:
        """What a restore reads (what a warm trial warms and residency measures)."""
        return [self.images, self.shm, self.saved_log]

    def bytes(self) -> int:
        return sum(f.stat().st_size for p in self.paths() for f in p.rglob("*") if f.is_file())


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def _ns_pid(pid: int) -> int:
    """pid as its own (innermost) PID namespace numbers it."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    raise RuntimeError(f"no NSpid for {pid}")


def _complete(port: int, served_name: str, timeout: float) -> str:
    body = {"model": served_name, "prompt": "The river", "max_tokens": 1, "temperature": 0.0}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return str(json.loads(resp.read())["choices"][0]["text"])


def first_token(port: int, served_name: str, proc: subprocess.Popen[bytes], timeout: float) -> str:
    """Poll (10 ms) until the server answers a one-token completion; its text."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"namespace init exited {proc.returncode} before serving")
        try:
            return _complete(port, served_name, timeout=120)
        except (urllib.error.URLError, ConnectionError, OSError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer on port {port} after {timeout}s") from None
            time.sleep(0.01)


def _wait_health(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's namespace exited {proc.returncode} while booting")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"vLLM not healthy on port {port} after {timeout}s")


def stop(proc: subprocess.Popen[bytes], port: int) -> None:
    """Kill the namespace (its init first: the kernel kills the rest) and wait for the port."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(60)
    if not wait_port_free("127.0.0.1", port, timeout=60):
        raise RuntimeError(f"port {port} still held after its namespace was killed")


def dump_whole_server(
    criu: Path, model: Path, served_name: str, port: int, work: Path, max_model_len: int = 512
) -> PlainImage:
    """Boot vLLM plainly, dump its whole tree with CRIU (it ends), save /dev/shm."""
    run, images, shm = work / "run", work / "images", work / "shm"
    for d in (run / "tmp", images, shm):
        d.mkdir(parents=True, exist_ok=True)
    opts = VllmOptions(
        model=str(model),
        served_name=served_name,
        port=port,
        max_model_len=max_model_len,
        worker_extension=None,
    )
    env = vllm_env("cpu", run_dir=str(run))
    vllm_log = work / "vllm.log"  # stays beside the images: the restored tree writes on
    init_argv = ["sh", "-c", BOOT_INIT, "sh", str(vllm_log), *seccomp.wrap(vllm_argv(opts))]
    with (work / "boot.log").open("wb") as out:
        proc = subprocess.Popen(
            [*UNSHARE, *init_argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        _wait_health(port, proc, timeout=900)
        init = _children(proc.pid)  # unshare --fork's child: the namespace's PID 1
        vllm = _children(init[0]) if init else []
        if len(vllm) != 1:
            raise RuntimeError(f"expected one vLLM under the namespace's init, found {vllm}")
        target = _ns_pid(vllm[0])
        dump = [
            "nsenter", "-t", str(init[0]), "-p", "-m", "--",
            str(criu), "dump", "-t", str(target), "-D", str(images),
            "-o", str(work / "dump.log"), "-v4", *COMMON_FLAGS,
        ]  # fmt: skip
        subprocess.run(dump, check=True, timeout=900)
        # The dump ended the tree; its /dev/shm lives on with the namespace's init.
        src = f"/proc/{init[0]}/root/dev/shm/."
        subprocess.run(["cp", "-a", "--sparse=always", src, str(shm)], check=True, timeout=600)
        saved_log = work / "vllm.log.dumped"
        saved_log.write_bytes(vllm_log.read_bytes())
    finally:
        stop(proc, port)
    return PlainImage(images, shm, vllm_log, saved_log, port, served_name)


def restore_argv(criu: Path, image: PlainImage, log: Path) -> list[str]:
    """The restore's command line: a fresh namespace whose init copies /dev/shm back and
    runs stock CRIU (detached, copying); CRIU's work files go beside its log."""
    criu_cmd = [
        str(criu), "restore", "-d", "-D", str(image.images), "-W", str(log.parent),
        "-o", str(log), "-v4", *COMMON_FLAGS,
    ]  # fmt: skip
    init = [str(image.shm), str(image.saved_log), str(image.log)]
    return [*UNSHARE, "sh", "-c", RESTORE_INIT, "sh", *init, *criu_cmd]


@dataclass
class PlainRun:
    ttft: float  # launch of the restore to the first token's answer
    criu_s: float | None  # the span of CRIU's own -v4 restore log (None: no log)


def restore_once(criu: Path, image: PlainImage, work: Path, timeout: float = 600) -> PlainRun:
    """One timed restore: launch to the first token; the namespace is killed afterwards."""
    log = work / "restore.log"
    log.unlink(missing_ok=True)
    (work / "stats-restore").unlink(missing_ok=True)
    t0 = time.monotonic()
    with (work / "restore.out").open("wb") as out:
        proc = subprocess.Popen(
            restore_argv(criu, image, log),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        first_token(image.port, image.served_name, proc, timeout)
        ttft = time.monotonic() - t0
    finally:
        stop(proc, image.port)
    return PlainRun(ttft=ttft, criu_s=_log_end(log))


def _log_end(log: Path) -> float | None:
    """Seconds CRIU's -v4 log spans (its restore's own duration), or None."""
    from rekindle_agent.checkpointing.criu import restore_log_profile

    try:
        return restore_log_profile(log.read_text(errors="replace"))["total_s"] or None
    except OSError:
        return None
