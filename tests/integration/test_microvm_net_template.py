"""A network policy on microVMs restored from a template (the real guest and agent): the
template is built with a NIC and no allow-list, each restore gets its own namespace, tap,
filter and address (set through the agent after the restore), and the policy holds there as
on a cold boot. Slow (a template build and restores under TCG): ``microvm_slow``."""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shlex
import shutil
import tempfile
from pathlib import Path

import pytest

from rollbox.backends.microvm import net as vmnet
from rollbox.backends.platform_work import run_shell
from rollbox.netpolicy import link
from tests.conftest import TEST_NODE, TEST_RUN, have_image, node_settings
from tests.helpers.vm_template import TEMPLATE_IMAGE, template_spec, vm_backend
from tests.integration.test_microvm_net_tap import PROBE
from tests.integration.test_netpolicy_targets import FakeInternet, internet  # noqa: F401

pytestmark = [pytest.mark.microvm_slow, pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]


async def probe(vm, *specs: tuple[str, str, int]) -> list[str]:  # noqa: ANN001
    """PROBE in the guest (as root, through the agent: the platform's shell runs python3)."""
    code, out = await run_shell(vm, f"python3 -c {shlex.quote(PROBE)} "
                                f"{shlex.quote(json.dumps(specs))}", {}, 60)
    assert code == 0, out
    return json.loads(out.decode().splitlines()[-1])


async def test_restored_vms_get_their_own_network(internet: FakeInternet) -> None:  # noqa: F811
    if not have_image(TEMPLATE_IMAGE):
        pytest.skip(f"needs {TEMPLATE_IMAGE}")
    d = Path(tempfile.mkdtemp(prefix=f"rollbox-test-{TEST_RUN}-"))
    d.chmod(0o711)
    settings = node_settings(d)
    settings.vm_templates = True
    settings.vm_accel = "tcg"
    a, b = internet.ips[0], internet.ips[1]
    try:
        async with vm_backend(settings) as backend:
            spec = dataclasses.replace(template_spec(settings), network_rules=(f"{a}:8080",))
            vms = []
            try:
                for _ in range(2):  # the first builds the template, both restore from it
                    sid = f"{TEST_NODE}nt{secrets.token_hex(3)}"
                    vms.append(await backend.create(sid, spec))
                    internet.route_from(sid)
                assert all(v.template for v in vms), [v.template for v in vms]
                ips = {v.network.link.sandbox_ip for v in vms}
                assert len(ips) == 2
                for v in vms:
                    assert await probe(v, ("tcp", a, 8080), ("tcp", b, 8080)) == [
                        "ok hi", "timeout"]
                await backend.set_network(vms[0], [f"{b}:8080"])
                assert await probe(vms[0], ("tcp", a, 8080), ("tcp", b, 8080)) == [
                    "timeout", "ok hi"]
                assert await probe(vms[1], ("tcp", a, 8080)) == ["ok hi"]
            finally:
                for v in vms:
                    await backend.destroy(v)
                    assert backend.leftovers(v.id) == []
                    assert not link.exists(v.id)
                    assert not Path(f"/run/netns/{vmnet.netns_name(v.id)}").exists()
                assert backend.templates is not None
                backend.templates.cache.clear()
                backend.disks.pool.release()
    finally:
        shutil.rmtree(d, ignore_errors=True)
