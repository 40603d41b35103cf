"""A node for the unmodified ``e2b`` SDK: a real edge, the real api app on a real port, and
E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY pointed at it for the time it is open.

The SDK (from 2.51, on pyqwest) keeps process-global connection pools not bound to an event
loop; each node has its own port, so pooled connections of an earlier node are never reused.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tests.conftest import TEST_RUN, node_settings

E2B_ENV = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN")


@contextlib.asynccontextmanager
async def e2b_node(project: str, port_domain: str | None = None
                   ) -> AsyncIterator[tuple[str, str, Any]]:
    """Yields (server url, an api key of ``project``, the edge); checks for leaks at the end.
    ``port_domain``: the api's per-sandbox origins' domain (E2B's ``get_host``)."""
    from rollbox.api import BackgroundServer, create_app
    from rollbox.api.ports import PortConfig
    from rollbox.compat.frontdoors import FRONT_DOORS
    from rollbox.edge.edge import Edge
    from rollbox.events.store import EventLog
    from rollbox.iam import KeyStore
    from rollbox.watcher import placement_over

    tmp = Path(tempfile.mkdtemp(prefix=f"rollbox-test-{TEST_RUN}-"))
    tmp.chmod(0o711)
    events = EventLog(tmp / "events.db")
    keys = KeyStore(tmp / "keys.db")
    edge = Edge(node_settings(tmp), events)
    await edge.start()
    saved = {k: os.environ.get(k) for k in E2B_ENV}
    try:
        app = create_app(placement_over([edge]), keys, front_doors=FRONT_DOORS,
                         port_config=PortConfig.ephemeral(port_domain))
        async with BackgroundServer(app) as srv:
            key = keys.create(project)
            os.environ["E2B_API_URL"] = f"{srv.url}/e2b"
            os.environ["E2B_SANDBOX_URL"] = f"{srv.url}/e2b/envd"
            os.environ["E2B_API_KEY"] = key
            yield srv.url, key, edge
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        left = list(edge.live)
        await edge.close(destroy=True)
        leaks = {sid: edge.leftovers(sid) for sid in left}
        events.close()
        keys.close()
        shutil.rmtree(tmp, ignore_errors=True)
        assert not {k: v for k, v in leaks.items() if v}, leaks


async def microvm_sandbox(edge: Any, project: str) -> Any:
    """A small busybox:test microVM sandbox on ``edge`` (the test is skipped when the node
    offers none); the caller deletes it."""
    import pytest

    from rollbox.models import Resources, SandboxSpec

    cap = (await edge.capacity())["backends"]["microvm"]
    if not cap["offered"]:
        pytest.skip(f"this node offers no microVMs: {cap['reason']}")
    sb = await edge.create(SandboxSpec(image="busybox:test", backend="microvm", resources=Resources(
        cpus=1, memory_mib=256, disk_mib=64)), project)
    assert sb.backend == "microvm"
    return sb
