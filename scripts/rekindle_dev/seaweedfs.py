"""A real S3-compatible server on loopback, SeaweedFS's `weed mini`: the store tests'
and `rekindle-dev bench store`'s.

scripts/build-seaweedfs builds it from its Go module (cached). Every port it
opens is chosen free and bound to 127.0.0.1; its telemetry (on by default) is
off, so it talks to nothing but this test.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

from rekindle_store.s3 import Bucket, Credentials, S3Error

REPO = Path(__file__).resolve().parents[2]

ACCESS_KEY = "rekindle-test"
SECRET_KEY = "rekindle-test-secret-key-0123456789"
# weed mini's servers, each an HTTP port and a gRPC port.
_SERVERS = ("master", "volume", "filer", "s3", "admin")
# Below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768 up by
# default), so that no outbound connection takes a port between its choice and a
# restart's bind.
_PORT_RANGE = (20000, 32767)
# Its capacity, fixed instead of derived from the host's free disk: weed mini
# sizes volumes (up to 1 GiB) and their count from free space at first start, and
# each bucket is a collection that grows volumes of its own, so on a fuller disk
# the tests' tenth bucket got HTTP 500 on its first PUT. Volumes are not
# preallocated: 400 of 64 MiB reserve nothing on disk.
SIZING_ARGS = ("-master.volumeSizeLimitMB=64", "-volume.max=400")


def build() -> Path:
    """The weed binary (scripts/build-seaweedfs: cached; a miss builds, minutes)."""
    res = subprocess.run(
        [str(REPO / "scripts" / "build-seaweedfs")],
        stdout=subprocess.PIPE,
        text=True,
        timeout=3600,
        check=False,
    )
    if res.returncode != 0:
        raise RuntimeError("scripts/build-seaweedfs failed (its progress is on stderr)")
    return Path(res.stdout.strip().splitlines()[-1])


def _free_port(taken: set[int]) -> int:
    """A port free on loopback now, below the ephemeral range, not in taken."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randint(*_PORT_RANGE)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {_PORT_RANGE}")


class SeaweedFS:
    """One `weed mini` process with its data under root; stop() and start() keep both."""

    def __init__(self, weed: Path, root: Path) -> None:
        self.weed = weed
        self.root = root
        taken: set[int] = set()
        self.ports = {name: (_free_port(taken), _free_port(taken)) for name in _SERVERS}
        self.proc: subprocess.Popen[bytes] | None = None
        (root / "data").mkdir(parents=True, exist_ok=True)
        config = {
            "identities": [
                {
                    "name": "rekindle",
                    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        (root / "s3.json").write_text(json.dumps(config))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3'][0]}"

    def bucket(self, name: str) -> Bucket:
        return Bucket(self.endpoint, name, Credentials(ACCESS_KEY, SECRET_KEY), timeout=10)

    def start(self, timeout: float = 60) -> None:
        argv = [
            str(self.weed),
            "mini",
            f"-dir={self.root / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-webdav=false",
            "-admin.ui=false",
            "-admin.port.legacy=0",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self.root / 's3.json'}",
            *SIZING_ARGS,
        ]
        for name, (http, grpc) in self.ports.items():
            argv += [f"-{name}.port={http}", f"-{name}.port.grpc={grpc}"]
        log = open(self.root / "weed.log", "ab")  # noqa: SIM115 - the process keeps it
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        probe = self.bucket("rekindle-probe")
        deadline = time.monotonic() + timeout
        while True:
            try:
                probe.create()
                return
            except S3Error as e:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"weed mini did not serve S3: {e}\n{self.log_tail()}") from e
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join((self.root / "weed.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""
