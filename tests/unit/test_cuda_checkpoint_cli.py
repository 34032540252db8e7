"""The cuda-checkpoint work-alike (rekindle_dev.cuda_checkpoint_cli): what CRIU's plugin
reads from it, without a driver. Its driver calls ran on an H100 (docs/bench/gpu)."""

from __future__ import annotations

import ctypes

import pytest
from rekindle_dev import cuda_checkpoint_cli as cli

A = "GPU-b87c6cdd-84d9-f52b-9eec-9be13420493a"
B = "GPU-e47a65c8-db51-ea8e-01ba-0568c2634db2"


def test_the_driver_structs_have_the_sizes_cuda_h_gives() -> None:
    # CUcheckpoint{Lock,Checkpoint,Restore,Unlock}Args are 64 bytes; a GPU pair two CUuuids.
    for struct in (cli._LockArgs, cli._Reserved, cli._RestoreArgs):
        assert ctypes.sizeof(struct) == 64, struct
    assert ctypes.sizeof(cli._GpuPair) == 32


def test_help_lists_what_the_plugin_looks_for(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["-h"]) == 0
    out = capsys.readouterr().out
    assert "--action" in out and "--device-map" in out


def test_device_map_parses_uuid_pairs_and_refuses_anything_else() -> None:
    assert cli.parse_device_map(f"{A}={B},{B}={A}") == [(A, B), (B, A)]
    assert cli.uuid_bytes(A)[:2] == [0xB8, 0x7C]
    with pytest.raises(ValueError, match="want OLD_UUID=NEW_UUID"):
        cli.parse_device_map(A)
    with pytest.raises(ValueError):
        cli.parse_device_map(f"{A}=GPU-not-a-uuid")


def test_without_a_driver_it_fails_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("a CUDA driver is installed here: the failure path is not reachable")
    except OSError:
        pass
    assert cli.main(["--get-state", "--pid", "1"]) == 1
    assert "cuda-checkpoint: libcuda.so.1" in capsys.readouterr().out
