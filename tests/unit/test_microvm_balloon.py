"""Parsing of the guest's word in balloon.py (guest-written: hostile) and the zeroing's size."""
from __future__ import annotations

from rollbox.backends.microvm import balloon


def test_memfree_is_read_capped_and_malformed_reads_as_nothing() -> None:
    info = b"MemTotal:  223768 kB\nMemFree:   179456 kB\nMemAvailable: 183884 kB\n"
    assert balloon.meminfo_free_mib(info, 256) == 179456 >> 10
    # a guest claiming more than its memory gets its memory at most
    assert balloon.meminfo_free_mib(b"MemFree: 99999999999 kB\n", 256) == 256
    for bad in (b"", b"MemFree: -5 kB\n", b"MemFree: 12 MB\n", b"MemFree: 1e9 kB\n",
                b"MemFree: 1234567890123 kB\n", b"MemFree:\n", b"\xff" * 100000,
                b"x\n" * 100 + b"MemFree: 100000 kB\n"):
        assert balloon.meminfo_free_mib(bad, 256) == 0, bad


def test_the_zeroing_leaves_a_margin_that_grows_with_the_guest() -> None:
    assert balloon.zero_fill_mib(175, 256) == 175 - balloon.ZERO_MARGIN_MIB
    assert balloon.zero_fill_mib(10, 256) == 0
    assert balloon.zero_fill_mib(4000, 4096) == 4000 - 4096 // 32


def test_an_idle_squeeze_is_done_only_where_it_frees_enough() -> None:
    target_mib = balloon.squeeze_target(256) >> 20
    # a restored idle 256 MiB VM (~81 MiB of QEMU anonymous memory): nothing to gain
    assert not balloon.worth_squeezing(81 << 20, 256)
    assert not balloon.worth_squeezing((target_mib + balloon.SQUEEZE_MIN_GAIN_MIB - 1) << 20, 256)
    # a cold-booted one, or one whose commands left page cache and freed memory: squeezed
    assert balloon.worth_squeezing((target_mib + balloon.SQUEEZE_MIN_GAIN_MIB) << 20, 256)
    assert balloon.worth_squeezing(160 << 20, 256)
