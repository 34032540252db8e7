from __future__ import annotations

import os
from pathlib import Path

from rekindle_agent.process_tree import shm_files


def _sparse_file(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(64 << 20)
        f.seek(1 << 20)
        f.write(b"A" * 4096)
        f.seek(40 << 20)
        f.write(b"B" * 10000)


def test_copy_sparse_keeps_content_and_holes(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    _sparse_file(src)
    copied = shm_files.copy_sparse(str(src), str(dst), mode=0o640)
    assert src.read_bytes() == dst.read_bytes()
    assert copied < 1 << 20  # only the data extents, not 64 MiB
    assert os.stat(dst).st_blocks * 512 < 1 << 20
    assert os.stat(dst).st_mode & 0o777 == 0o640


def test_tree_shm_files_from_maps_and_fds(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "5" / "fd").mkdir(parents=True)
    (proc / "5" / "maps").write_text(
        "7f00-7f10 rw-s 00000000 00:1a 3 /dev/shm/psm_abc\n"
        "7f10-7f20 rw-s 00000000 00:1a 4 /dev/shm/sem.mp-x1 (deleted)\n"
        "7f20-7f30 r-xp 00000000 08:01 5 /usr/lib/libc.so.6\n"
        "7f30-7f40 rw-p 00000000 00:00 0 \n"
    )
    os.symlink("/dev/shm/vllm_mq_1", proc / "5" / "fd" / "9")
    os.symlink("socket:[123]", proc / "5" / "fd" / "3")
    names = shm_files.tree_shm_files([5, 6], proc=proc)
    assert names == {"psm_abc", "sem.mp-x1", "vllm_mq_1"}


def test_save_recreate_roundtrip_and_clear(tmp_path: Path) -> None:
    fake_shm, store = tmp_path / "shm", tmp_path / "ckpt" / "shm"
    fake_shm.mkdir()
    _sparse_file(fake_shm / "psm_1")
    (fake_shm / "sem.mp-2").write_bytes(b"x" * 32)
    os.chmod(fake_shm / "sem.mp-2", 0o644)
    recs = shm_files.save({"psm_1", "sem.mp-2", "gone"}, store, shm_dir=str(fake_shm))
    assert [r["name"] for r in recs] == ["psm_1", "sem.mp-2"]  # 'gone' does not exist
    original = {n: (fake_shm / n).read_bytes() for n in ("psm_1", "sem.mp-2")}
    removed = shm_files.clear_stale(str(fake_shm))
    assert removed == ["psm_1", "sem.mp-2"] and not any(fake_shm.iterdir())
    shm_files.recreate(recs, store, shm_dir=str(fake_shm))
    for name, data in original.items():
        assert (fake_shm / name).read_bytes() == data
    assert os.stat(fake_shm / "sem.mp-2").st_mode & 0o777 == 0o644
    assert shm_files.clear_stale(str(fake_shm), in_use={"psm_1"}) == ["sem.mp-2"]
