"""Kubernetes resource quantities as integers (bytes, millicores): no float rounding surprises."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIX: dict[str, int | Decimal] = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_RE = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]{0,2})$")

MiB = 2**20
GiB = 2**30


def parse_quantity(value: str | int | float) -> Decimal:
    """A quantity ("1536Mi", "1.5Gi", "500m", 3) as an exact Decimal in base units."""
    if isinstance(value, int | float):
        return Decimal(str(value))
    m = _RE.match(value.strip())
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(
            f"{value!r} is not a Kubernetes quantity: write e.g. '512Mi', '4Gi' or '1.5Gi'"
        )
    try:
        number = Decimal(m.group(1))
    except InvalidOperation as e:
        raise ValueError(f"{value!r} is not a Kubernetes quantity") from e
    return number * Decimal(_SUFFIX[m.group(2)])


def to_bytes(value: str | int | float) -> int:
    """Bytes, rounded up (a byte short of a size is a SIGBUS later)."""
    q = parse_quantity(value)
    whole = int(q)
    return whole + (1 if q > whole else 0)


def mib_str(nbytes: int) -> str:
    """nbytes rounded up to a whole MiB, as a quantity string ("1216Mi")."""
    return f"{-(-nbytes // MiB)}Mi"


def gib_float(nbytes: int) -> float:
    return nbytes / GiB


def human_bytes(nbytes: int) -> str:
    """Short human size for printer columns ("2.7Gi", "640Mi")."""
    for unit, size in (("Ti", 2**40), ("Gi", GiB), ("Mi", MiB), ("Ki", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f}{unit}"
    return f"{nbytes}B"
