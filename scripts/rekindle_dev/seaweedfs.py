"""A real S3-compatible server on loopback, SeaweedFS's `weed mini`: the store tests'
and `rekindle-dev bench store`'s.

scripts/build-seaweedfs builds it from its Go module (cached). Every port it
opens is chosen free and bound to 127.0.0.1; its telemetry (on by default) is
off, so it talks to nothing but this test.
"""

from __future__ import annotations

import json
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SeaweedFS:
    """One `weed mini` process with its data under root; stop() and start() keep both."""

    def __init__(self, weed: Path, root: Path) -> None:
        self.weed = weed
        self.root = root
        self.ports = {name: (_free_port(), _free_port()) for name in _SERVERS}
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
