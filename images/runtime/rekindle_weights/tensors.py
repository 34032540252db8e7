"""Small helpers to see a tensor's memory as bytes, shared by dump, reload and digest."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * int(t.element_size())


def is_dense(t: torch.Tensor) -> bool:
    """True when the tensor's elements are exactly its row-major bytes (readable in place)."""
    return bool(t.is_contiguous())


def host_bytes(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a dense CPU tensor's bytes (no copy; the GIL-free read target).

    Through ctypes rather than numpy because numpy has no bfloat16/float8.
    """
    if t.device.type != "cpu" or not is_dense(t):
        raise ValueError("host_bytes needs a contiguous CPU tensor")
    n = nbytes(t)
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def byte_tensor(t: torch.Tensor) -> torch.Tensor:
    """The same memory as a flat uint8 tensor (any device), for byte-range copies."""
    import torch

    flat = t.reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    return flat.view(torch.uint8)


def model_tensors(model: torch.nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(name, "param"|"buffer", tensor) for every parameter and buffer, shared ones once."""
    for name, p in model.named_parameters():
        yield name, "param", p.data
    for name, b in model.named_buffers():
        yield name, "buffer", b
