"""A stand-in for the Hugging Face hub on loopback, serving models from a local directory.

Only what the hub client's snapshot download asks for: the model API (commit
and file list) and file downloads by revision. ROOT/ORG/NAME/ is one
repository; its commit is a digest of its files, and the branch `main` points
at it. Every request is recorded (path, method, Authorization header), so
tests can assert what was downloaded and that the token was sent.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit


def repo_commit(repo: Path) -> str:
    """A 40-hex id of the repository's content (what the hub's commit sha looks like)."""
    h = hashlib.sha1()
    for f in sorted(p for p in repo.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(repo)}\0".encode() + f.read_bytes())
    return h.hexdigest()


@dataclass
class FakeHub:
    root: Path
    url: str = ""
    token: str | None = None  # when set, requests without it get 401
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # method, path, auth

    def downloads(self) -> list[str]:
        """The file GETs (not the API calls, not HEADs)."""
        return [p for m, p, _ in self.requests if m == "GET" and "/resolve/" in p]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, code: int, body: bytes, headers: dict[str, str], send: bool) -> None:
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if send:
                self.wfile.write(body)

        def _repo(self, parts: list[str]) -> tuple[Path, list[str]] | None:
            # Repositories are ORG/NAME here (the hub's NAME-only legacy ids are not served).
            if len(parts) < 2 or not hub.root.joinpath(*parts[:2]).is_dir():
                return None
            return hub.root.joinpath(*parts[:2]), parts[2:]

        def _serve(self, send: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            auth = self.headers.get("Authorization", "")
            hub.requests.append((self.command, path, auth))
            if hub.token and auth != f"Bearer {hub.token}":
                self._reply(401, b"unauthorized", {"X-Error-Code": "GatedRepo"}, send)
                return
            parts = [p for p in path.split("/") if p]
            if parts[:2] == ["api", "models"]:
                self._api(parts[2:], send)
            else:
                self._file(parts, send)

        def _api(self, parts: list[str], send: bool) -> None:
            found = self._repo(parts)
            if found is None:
                self._reply(404, b"{}", {"X-Error-Code": "RepoNotFound"}, send)
                return
            repo, rest = found
            commit = repo_commit(repo)
            if rest[:1] in (["revision"], ["tree"]) and rest[1:2] not in (["main"], [commit]):
                self._reply(404, b"{}", {"X-Error-Code": "RevisionNotFound"}, send)
                return
            files = sorted(str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file())
            if rest[:1] == ["tree"]:  # the file list (recursive, one page)
                tree = [
                    {
                        "type": "file",
                        "path": f,
                        "size": (repo / f).stat().st_size,
                        "oid": hashlib.sha1((repo / f).read_bytes()).hexdigest(),
                    }
                    for f in files
                ]
                headers = {"Content-Type": "application/json"}
                self._reply(200, json.dumps(tree).encode(), headers, send)
                return
            repo_id = str(repo.relative_to(hub.root))
            body = {
                "id": repo_id,
                "modelId": repo_id,
                "sha": commit,
                "private": False,
                "siblings": [{"rfilename": f} for f in files],
            }
            self._reply(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, send)

        def _file(self, parts: list[str], send: bool) -> None:
            if "resolve" not in parts:
                self._reply(404, b"", {}, send)
                return
            i = parts.index("resolve")
            found = self._repo(parts[:i])
            if found is None or len(parts) < i + 3:
                self._reply(404, b"", {"X-Error-Code": "EntryNotFound"}, send)
                return
            repo, _ = found
            commit = repo_commit(repo)
            if parts[i + 1] not in ("main", commit):
                self._reply(404, b"", {"X-Error-Code": "RevisionNotFound"}, send)
                return
            f = repo.joinpath(*parts[i + 2 :])
            if not f.is_file():
                self._reply(404, b"", {"X-Error-Code": "EntryNotFound"}, send)
                return
            data = f.read_bytes()
            etag = hashlib.sha256(data).hexdigest()
            headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"'}
            self._reply(200, data, headers, send)

        def do_GET(self) -> None:
            self._serve(send=True)

        def do_HEAD(self) -> None:
            self._serve(send=False)

    return Handler


@contextmanager
def serve(root: Path, token: str | None = None, host: str = "127.0.0.1") -> Iterator[FakeHub]:
    """The fake hub on host (loopback, or this machine's node address for pods) and a
    free port, for the duration of the block."""
    hub = FakeHub(root=root, token=token)
    server = ThreadingHTTPServer((host, 0), _handler(hub))
    hub.url = f"http://{host}:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
