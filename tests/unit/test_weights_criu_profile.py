"""CRIU's own restore timing as the restore profile reads it (rekindle_agent.checkpointing.criu).

Named with the weights tests' prefix because it belongs to the same performance
work (docs/restore-profile.md); pure parsing, no CRIU needed.
"""

from __future__ import annotations

import pytest
from rekindle_agent.checkpointing import criu

# A real stats-restore written by CRIU 4.2.1 (patched) after a restore of vLLM's tree.
REAL_STATS = bytes.fromhex("40591055063309571200000012100800100018a10b208a81f6012892b91a")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _stats(fields: dict[int, int]) -> bytes:
    entry = b"".join(_varint(num << 3) + _varint(v) for num, v in fields.items())
    msg = _varint(2 << 3 | 2) + _varint(len(entry)) + entry
    return (
        (0x55105940).to_bytes(4, "little")
        + (0x57093306).to_bytes(4, "little")
        + len(msg).to_bytes(4, "little")
        + msg
    )


def test_real_stats_image() -> None:
    got = criu.parse_restore_stats(REAL_STATS)
    assert got == {
        "pages_compared": 0,
        "pages_skipped_cow": 0,
        "forking_us": 1441,
        "restore_us": 4030602,
        "pages_restored": 433298,
    }


def test_built_stats_round_trip() -> None:
    want = {1: 5, 2: 7, 3: 123456, 4: 2_000_000, 5: 1 << 40}
    got = criu.parse_restore_stats(_stats(want))
    assert got["forking_us"] == 123456
    assert got["restore_us"] == 2_000_000
    assert got["pages_restored"] == 1 << 40
    assert got["pages_compared"] == 5


@pytest.mark.parametrize(
    "data", [b"", b"\x00" * 12, REAL_STATS[:4] + b"\x00\x00\x00\x00" + REAL_STATS[8:]]
)
def test_not_a_stats_image(data: bytes) -> None:
    with pytest.raises(ValueError):
        criu.parse_restore_stats(data)


LOG = """\
(00.000000) CRIU run id = x
(00.016088) sockets: Done probing
(00.242583) Forking task with 10002 pid (flags 0x0)
(00.297215)  10002: Forking task with 10017 pid (flags 0x0)
(00.369251)  10016: mmap-restore: 0x7fc55f8cb000-0x7fc55f8fd000 from pages-2.img at 0x1cd000
(00.400000) pie: 10017: Preadv 0x5635aa543000:4096... (93 iovs)
(00.410000) pie: 10031: Preadv 0x556f7d4ed000:4096... (110 iovs)
(01.000000) pie: 10017: `- returned 208097280
(01.100000) pie: 10031: `- returned 100000
(01.200000) pie: 10031: Preadv 0x7f:4096... (1 iovs)
(01.300000) pie: 10031: `- returned 4096
(01.500000) Restore finished successfully. Tasks resumed.
"""


def test_log_profile() -> None:
    prof = criu.restore_log_profile(LOG)
    assert prof["setup_s"] == pytest.approx(0.242583)
    # 10031: 0.69 + 0.1 s in two reads; 10017: 0.6 s; tasks run in parallel: the largest.
    assert prof["read_s"] == pytest.approx(0.79)
    assert prof["read_bytes"] == 208097280 + 100000 + 4096
    assert prof["mapped_bytes"] == 0x7FC55F8FD000 - 0x7FC55F8CB000
    assert prof["total_s"] == pytest.approx(1.5)


def test_log_profile_of_nothing() -> None:
    assert criu.restore_log_profile("no timestamps here\n")["read_s"] == 0.0
