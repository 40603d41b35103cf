"""Red team F42: clones of one template VM that share what a restore copies: the guest kernel's
RNG state (and with it UUIDs, ASLR, stack canaries, Python's ``random`` seed), boot id,
machine-id, hostname, and what a clone wrote. Two sandboxes restored from the session's
template (tests/conftest.py ``vm_template_node``) must differ in each, and a secret one clone
writes reaches neither the other clone nor a later restore. (The template lane's own test
covers /dev/urandom, machine-id, hostname and ``random`` for the restore path itself.)"""
from __future__ import annotations

import asyncio

from rollbox.backends.microvm.backend import MicroVM
from rollbox.backends.platform_work import run_shell
from rollbox.config import Settings
from tests.helpers.vm_template import template_spec, vm_backend
from tests.redteam.conftest import needs_root

pytestmark = needs_root

PROBE = ("import os, random, socket\n"
         "def read(p):\n"
         "    return open(p).read().strip() if os.path.exists(p) else 'none'\n"
         "print(read('/proc/sys/kernel/random/uuid'))\n"
         "print(read('/proc/sys/kernel/random/boot_id'))\n"
         "print(os.urandom(16).hex())\n"
         "print(read('/etc/machine-id'))\n"
         "print(socket.gethostname())\n"
         "print(random.random())\n"
         "print([m for m in open('/proc/self/maps') if '[stack]' in m][0].split('-')[0])\n"
         "print(read('/root/secret'))\n")
FIELDS = ["uuid", "boot_id", "urandom", "machine_id", "hostname", "random", "aslr", "secret"]


async def probe(vm: MicroVM) -> dict[str, str]:
    code, out = await run_shell(vm, f"python3 -c \"{PROBE}\"", vm.image_env, 120)
    assert code == 0, out
    return dict(zip(FIELDS, out.decode().split("\n"), strict=False))


async def test_f42_template_clones_share_no_secret(vm_template_node: Settings) -> None:
    settings = vm_template_node
    async with vm_backend(settings) as b:
        spec = template_spec(settings)
        ids = [f"{settings.node_id}-f42{i}" for i in range(3)]
        vms = await asyncio.gather(*(b.create(i, spec) for i in ids[:2]))
        try:
            assert vms[0].template and vms[0].template == vms[1].template  # two clones
            a, c = [await probe(vm) for vm in vms]
            same = [k for k in FIELDS if k != "secret" and a[k] == c[k]]
            assert same == [], (same, a, c)
            assert len(a["machine_id"]) == 32 and a["secret"] == c["secret"] == "none", (a, c)
            code, out = await run_shell(vms[0], "echo token-$RANDOM > /root/secret && sync",
                                        vms[0].image_env, 60)
            assert code == 0, out
            assert (await probe(vms[1]))["secret"] == "none"  # not in the other clone
        finally:
            for vm in vms:
                await b.destroy(vm)
        later = await b.create(ids[2], spec)  # nor in the template a later clone restores
        try:
            assert later.template == vms[0].template
            d = await probe(later)
            assert d["secret"] == "none" and d["urandom"] not in (a["urandom"], c["urandom"])
        finally:
            await b.destroy(later)
        assert all(b.leftovers(i) == [] for i in ids)
