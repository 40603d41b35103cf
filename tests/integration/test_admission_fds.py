"""The edge's descriptor budget per sandbox kind (admission, Backend.edge_fds), on a real edge
in a process of its own whose RLIMIT_NOFILE (soft and hard) is lowered to a table with room
for 20 sandbox descriptors (FD_RESERVE + 22, 10% of them kept for grades): networked
containers (6 each) are refused, typed, at the fourth, while a container without network (2)
still fits; nothing of the refused creates is left and every sandbox is gone at the end."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from rollbox.edge.admission import FD_RESERVE
from tests.conftest import node_settings

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]
REPO = Path(__file__).resolve().parents[2]
NOFILE = FD_RESERVE + 22

DRIVER = r"""
import asyncio, json, os, resource, sys
import rollbox.edge.edge as edge_mod
from rollbox import errors
from rollbox.config import Settings
from rollbox.events.store import EventLog
from rollbox.models import NetworkPolicy, SandboxSpec

edge_mod.raise_nofile_limit = lambda *a, **k: None  # the table stays as the test set it

def out(**kw):
    print(json.dumps(kw), flush=True)

async def main():
    s = Settings()
    events = EventLog(s.data_dir / "events.db")
    edge = edge_mod.Edge(s, events)
    await edge.start()
    made = []
    try:
        out(nofile=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            max_fds=edge.limits.max_fds, max_sandboxes=edge.limits.max_sandboxes)
        net = SandboxSpec(image="busybox:test",
                          network=NetworkPolicy(allow=["10.255.255.1:443"]))
        for i in range(4):
            try:
                made.append((await edge.create(net, "p")).id)
                out(create=i, ok=True, fds=edge.admission.fds)
            except errors.RollboxError as exc:
                out(create=i, ok=False, error=exc.code, reason=exc.details.get("reason"),
                    retryable=exc.retryable, fds=edge.admission.fds,
                    live=len(edge.live))
        plain = await edge.create(SandboxSpec(image="busybox:test"), "p")
        made.append(plain.id)
        out(plain=True, fds=edge.admission.fds)
        try:  # a network attached later needs its descriptors too
            await edge.set_network(plain.id, NetworkPolicy(allow=["10.255.255.1:443"]))
            out(set_network=True)
        except errors.RollboxError as exc:
            out(set_network=False, reason=exc.details.get("reason"), fds=edge.admission.fds,
                networked=edge.live[plain.id].box.network is not None)
        for sid in made:
            await edge.delete(sid)
        out(deleted=len(made), fds=edge.admission.fds,
            leftovers=[x for sid in made for x in edge.leftovers(sid)])
    finally:
        await edge.close(destroy=True)
        events.close()

asyncio.run(main())
"""


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def test_networked_creates_are_refused_at_the_fd_budget_and_nothing_leaks(
        tmp_node_dir: Path) -> None:
    s = node_settings(tmp_node_dir)
    env = {**os.environ, **s.environ(), "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}
    p = subprocess.run([sys.executable, "-c", DRIVER], env=env, cwd=REPO, preexec_fn=_limit,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    head, creates = lines[0], [x for x in lines if "create" in x]
    assert head["nofile"] == NOFILE and head["max_fds"] == 22
    assert head["max_sandboxes"] == 11  # by count alone: 10 new creates would pass
    assert [c["ok"] for c in creates] == [True, True, True, False]
    refused = creates[3]
    assert refused["error"] == "capacity" and refused["reason"] == "fds"
    assert refused["retryable"] and refused["fds"] == 18 and refused["live"] == 3
    plain = next(x for x in lines if "plain" in x)
    assert plain["fds"] == 20  # a container without network holds 2: it fits
    net = next(x for x in lines if "set_network" in x)
    assert net == {"set_network": False, "reason": "fds", "fds": 20, "networked": False}
    end = next(x for x in lines if "deleted" in x)
    assert end == {"deleted": 4, "fds": 0, "leftovers": []}
    assert not [n for n in os.listdir("/run/netns") if s.node_id in n]
