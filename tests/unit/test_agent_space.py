"""The checkpoint's size estimate and the free-space check (pure logic, a fake /proc)."""

from __future__ import annotations

from pathlib import Path

from rekindle_agent.checkpointing import space


def test_anonymous_memory_is_summed_over_the_tree(tmp_path: Path) -> None:
    for pid, kib in ((10, 1024), (11, 2048)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "smaps_rollup").write_text(
            f"Rss:  9999 kB\nAnonymous:  {kib} kB\nSwap:  0 kB\n"
        )
    # A process gone meanwhile is skipped (the margin covers it).
    assert space.anonymous_bytes([10, 11, 12], proc=str(tmp_path)) == 3 << 20


def test_weights_on_device_come_from_the_model_files(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "pytorch_model.bin").write_bytes(b"x" * 24)
    (tmp_path / "config.json").write_text("{}")
    assert space.weight_file_bytes(str(tmp_path)) == 1024
    assert space.weight_file_bytes(str(tmp_path / "missing")) == 0


def test_needed_has_a_margin_and_problem_says_what_to_do(tmp_path: Path) -> None:
    need = space.needed_bytes(anonymous=1 << 30, shm=0, device_weights=0)
    assert need == (1 << 30) + (1 << 30) // 10 + space.MARGIN_BYTES
    assert space.problem(tmp_path, need, need) is None
    why = space.problem(tmp_path / "c1", need, need - 1)
    assert why is not None and "1.16 GiB needed" in why and "delete old checkpoints" in why


def test_free_space_is_read_where_the_checkpoint_will_be(tmp_path: Path) -> None:
    # The checkpoint's directory does not exist yet: its nearest existing parent counts.
    assert space.free_bytes(tmp_path / "not" / "yet") == space.free_bytes(tmp_path) > 0
