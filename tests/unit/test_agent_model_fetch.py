"""`rekindle fetch-model` for real: the hub client against a stand-in hub on loopback.

The stand-in (tests/fake_hub.py) serves a local directory the way the hub's
API and file downloads answer; the real huggingface_hub client downloads from
it. Checked: the files land complete in the layout the operator points vLLM
at, the token is sent, a cached revision is not downloaded again (a commit pin
needs no network at all), replicas fetching at once download once, a moved
branch is followed, an unreachable hub falls back on the cache, and a failed
download leaves nothing a later fetch would take for complete.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from rekindle_agent import cli, model_fetch
from rekindle_contract.model_cache import model_path

from tests.fake_hub import repo_commit, serve

TOKEN = "hf_plantedtoken1234"


@pytest.fixture
def hub_root(tmp_path: Path) -> Path:
    repo = tmp_path / "hub" / "org" / "tiny"
    (repo / "sub").mkdir(parents=True)
    (repo / "config.json").write_text('{"model_type": "llama"}')
    (repo / "sub" / "model.safetensors").write_bytes(os.urandom(300_000))
    return tmp_path / "hub"


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HOME", "/nonexistent-hf-home")
    return TOKEN


def files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_fetch_downloads_into_the_operators_path(
    hub_root: Path, tmp_path: Path, token: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    with serve(hub_root, token=token) as hub:
        rc = cli.main(
            ["fetch-model", "--id", "org/tiny", "--revision", "main", "--cache", str(cache),
             "--endpoint", hub.url]
        )  # fmt: skip
    assert rc == 0
    ref = Path(capsys.readouterr().out.strip())
    assert str(ref) == model_path("org/tiny", "main", str(cache))
    assert files(ref) == files(hub_root / "org" / "tiny")  # complete, nothing of the client's
    commit = repo_commit(hub_root / "org" / "tiny")
    assert os.readlink(ref) == f"../snapshots/{commit}"
    assert all(auth == f"Bearer {token}" for _, _, auth in hub.requests)
    assert sorted(hub.downloads()) == [
        f"/org/tiny/resolve/{commit}/config.json",
        f"/org/tiny/resolve/{commit}/sub/model.safetensors",
    ]
    assert not list((cache / "models--org--tiny").glob(".tmp-*"))
    assert token not in capsys.readouterr().err


def test_cached_revision_is_not_downloaded_again(
    hub_root: Path, tmp_path: Path, token: str
) -> None:
    cache = tmp_path / "cache"
    commit = repo_commit(hub_root / "org" / "tiny")
    with serve(hub_root, token=token) as hub:
        model_fetch.fetch("org/tiny", "main", cache, hub.url)
        n = len(hub.downloads())
        model_fetch.fetch("org/tiny", "main", cache, hub.url)  # a branch: one lookup only
        assert len(hub.downloads()) == n
        model_fetch.fetch("org/tiny", commit, cache, hub.url)  # same commit, pinned
        assert len(hub.downloads()) == n
        seen = len(hub.requests)
    # A commit pin already in the cache needs no hub at all.
    ref = model_fetch.fetch("org/tiny", commit, cache, "http://127.0.0.1:9")
    assert files(ref) == files(hub_root / "org" / "tiny")
    assert seen == len(hub.requests)


def test_replicas_fetching_at_once_download_once(
    hub_root: Path, tmp_path: Path, token: str
) -> None:
    cache = tmp_path / "cache"
    errors: list[BaseException] = []

    def one(url: str) -> None:
        try:
            model_fetch.fetch("org/tiny", "main", cache, url)
        except BaseException as e:  # reported below
            errors.append(e)

    with serve(hub_root, token=token) as hub:
        threads = [threading.Thread(target=one, args=(hub.url,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors
    assert len(hub.downloads()) == 2  # each file once, whoever held the lock
    assert files(cache / "models--org--tiny" / "refs" / "main") == files(hub_root / "org" / "tiny")


def test_moved_branch_is_followed_and_old_snapshot_kept(
    hub_root: Path, tmp_path: Path, token: str
) -> None:
    cache = tmp_path / "cache"
    with serve(hub_root, token=token) as hub:
        ref = model_fetch.fetch("org/tiny", "main", cache, hub.url)
        old = os.readlink(ref)
        (hub_root / "org" / "tiny" / "config.json").write_text('{"model_type": "qwen"}')
        ref = model_fetch.fetch("org/tiny", "main", cache, hub.url)
    assert os.readlink(ref) != old
    assert (ref / "config.json").read_text() == '{"model_type": "qwen"}'
    assert (ref.parent / old).is_dir()  # a running replica may still read the old files


def test_unreachable_hub_uses_the_cached_branch(
    hub_root: Path, tmp_path: Path, token: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    with serve(hub_root, token=token) as hub:
        model_fetch.fetch("org/tiny", "main", cache, hub.url)
    ref = model_fetch.fetch("org/tiny", "main", cache, "http://127.0.0.1:9")
    assert files(ref) == files(hub_root / "org" / "tiny")
    assert "hub unreachable" in capsys.readouterr().err


def test_errors_say_what_to_check(hub_root: Path, tmp_path: Path, token: str) -> None:
    cache = tmp_path / "cache"
    with (
        serve(hub_root, token=token) as hub,
        pytest.raises(model_fetch.FetchError, match=r"spec\.model\.huggingFace\.id"),
    ):
        model_fetch.fetch("org/missing", "main", cache, hub.url)
    with (
        serve(hub_root, token="another-token") as hub,
        pytest.raises(model_fetch.FetchError, match="token Secret"),
    ):
        model_fetch.fetch("org/tiny", "main", cache, hub.url)
    with pytest.raises(ValueError, match="ORG/NAME"):
        model_fetch.fetch("../etc", "main", cache, None)


def test_failed_download_leaves_no_snapshot(hub_root: Path, tmp_path: Path, token: str) -> None:
    cache = tmp_path / "cache"

    def broken(repo_id: str, commit: str, dest: Path, endpoint: str | None) -> None:
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("half")
        raise ConnectionError("connection reset")

    with serve(hub_root, token=token) as hub:
        with pytest.raises(model_fetch.FetchError, match="connection reset"):
            model_fetch.fetch("org/tiny", "main", cache, hub.url, download=broken)
        repo = cache / "models--org--tiny"
        assert not list((repo / "snapshots").iterdir()) and not list(repo.glob(".tmp-*"))
        assert not (repo / "refs" / "main").exists()
        # The next fetch starts clean and completes.
        ref = model_fetch.fetch("org/tiny", "main", cache, hub.url)
    assert files(ref) == files(hub_root / "org" / "tiny")
