"""The seccomp profile's ioctl numbers are the kernel's: derived by compiling the kernel's
definitions (tests/helpers/ioctl_numbers.c), never compared with another hand-written copy."""
from __future__ import annotations

from rollbox.isolation import seccomp
from tests.helpers.ioctl_numbers import ALIASES, kernel_ioctl_numbers


def test_every_denied_ioctl_number_is_the_kernels() -> None:
    kernel = kernel_ioctl_numbers()
    assert {n: kernel.get(n) for n in seccomp.DENY_IOCTLS} == seccomp.DENY_IOCTLS


def test_every_extent_ioctl_the_kernel_defines_is_denied() -> None:
    # A new name in ioctl_numbers.c (or an alias with another number) must reach the filter.
    kernel = kernel_ioctl_numbers()
    denied = set(seccomp.DENY_IOCTLS.values())
    assert {n for n, v in kernel.items() if v not in denied} == set()
    assert all(kernel[a] == kernel[n] for a, n in ALIASES.items())


def test_profile_compares_each_number_on_its_low_32_bits() -> None:
    rules = [r for r in seccomp.profile()["syscalls"] if r["names"] == ["ioctl"]]
    got = {(a["index"], a["value"], a["valueTwo"], a["op"]) for r in rules for a in r["args"]}
    assert got == {(1, 0xFFFFFFFF, n, "SCMP_CMP_MASKED_EQ") for n in seccomp.DENY_IOCTLS.values()}
    assert all(r["action"] == "SCMP_ACT_ERRNO" and r["errnoRet"] == 1 for r in rules)
