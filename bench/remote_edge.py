"""The api over a local edge vs over a ``RemoteEdge`` to the same edge served over HTTP
(`rollbox bench remote_edge [--json]`): what the cluster's extra hop (api -> edge over HTTP,
``edge.service``) costs.

One real edge on this host in a scratch dir; two api servers in this process (real uvicorn):
one over the edge itself (``rollbox serve``'s path), one over a ``RemoteEdge`` to it served
with ``serve_edge`` on loopback (the cluster's path). From one SDK client each, interleaved in
thirds so the load on a shared machine hits both alike:

* ``exec(["true"])`` round trips through the api (start + output stream: two edge calls);
* create + delete of a busybox container sandbox through the api;
* straight to the edge (no api): ``capacity()`` and ``exec_start`` + ``exec_wait`` round trips,
  and the replay of a finished command's output of 10,000 lines (``exec_stream``, thousands of
  items: the framing's cost per item), ``Edge`` vs ``RemoteEdge``.

Ratios are remote over local of the p50 (1.0: the hop costs nothing). Ends with one JSON line.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rollbox.benchkit import emit, latency_ms, ratio, round_trips, say

WORKLOADS = ("exec", "create_delete", "edge_capacity", "edge_exec", "edge_replay")


async def bench(quick: bool) -> dict[str, Any]:
    import rollbox
    from rollbox.api import BackgroundServer, create_app
    from rollbox.config import Settings
    from rollbox.edge.edge import Edge
    from rollbox.edge.remote import RemoteEdge
    from rollbox.edge.service import serve_edge
    from rollbox.events.store import EventLog
    from rollbox.iam import KeyStore
    from rollbox.models import ExecSpec
    from rollbox.watcher import placement_over

    tmp = Path(tempfile.mkdtemp(prefix="rollbox-bench-remote-"))
    tmp.chmod(0o711)
    s = Settings.scratch(tmp)
    s.node_id = "br" + secrets.token_hex(3)
    events = EventLog(tmp / "events.db")
    edge = Edge(s, events)
    await edge.start()
    token = secrets.token_urlsafe(24)
    image = "busybox:test" if edge.store.exists("busybox:test") else "debian:bookworm"
    n_exec, n_create, n_edge, n_replay = (60, 6, 150, 6) if quick else (300, 30, 600, 30)
    out: dict[str, Any] = {"quick": quick, "image": image, "loadavg_start": os.getloadavg()}
    keys = KeyStore(tmp / "keys.db")
    key = keys.create("bench")
    try:
        async with serve_edge(edge, "127.0.0.1", 0, token) as edge_srv:
            remote = RemoteEdge(edge.node_id, edge_srv.url, token)
            local_app = create_app(placement_over([edge]), keys)
            # The edge writes the audit trail itself (as on a cluster node).
            remote_app = create_app(placement_over([remote]), keys)
            async with BackgroundServer(local_app) as lsrv, BackgroundServer(remote_app) as rsrv, \
                    rollbox.AsyncClient(lsrv.url, key) as lc, \
                    rollbox.AsyncClient(rsrv.url, key) as rc:
                lsb, rsb = await lc.create(image), await rc.create(image)
                sides = {"local": (lc, lsb, edge), "remote": (rc, rsb, remote)}
                lat: dict[str, list[float]] = {f"{w}_{side}": [] for w in WORKLOADS
                                               for side in sides}
                quiet = await lc.create(image)  # only the replayed command: never forgotten
                loud = await edge.exec_start(quiet.id, ExecSpec(
                    cmd="i=0; while [ $i -lt 10000 ]; do i=$((i+1)); echo line $i; done"))
                await edge.exec_wait(quiet.id, loud)
                out["edge_replay_items"] = len([x async for x in edge.exec_stream(quiet.id,
                                                                                  loud)])
                say(f"exec/create through the api, {image}, local vs remote edge ...")
                for third in range(3):
                    for side, (client, sb, face) in sides.items():
                        async def ex(sb: Any = sb) -> None:
                            r = await sb.exec(["true"])
                            assert r.exit_code == 0, r

                        async def cd(client: Any = client) -> None:
                            made = await client.create(image)
                            await made.delete()

                        async def cap(face: Any = face) -> None:
                            await face.capacity()

                        async def eex(face: Any = face, sid: str = sb.id) -> None:
                            eid = await face.exec_start(sid, ExecSpec(cmd=["true"]))
                            assert (await face.exec_wait(sid, eid)).exit_code == 0

                        async def replay(face: Any = face) -> None:
                            items = [x async for x in face.exec_stream(quiet.id, loud)]
                            assert items[-1].kind == "exit"

                        w = 10 if third == 0 else 0
                        lat[f"exec_{side}"] += await round_trips(ex, n_exec // 3, w)
                        lat[f"create_delete_{side}"] += await round_trips(cd, n_create // 3,
                                                                          1 if w else 0)
                        lat[f"edge_capacity_{side}"] += await round_trips(cap, n_edge // 3, w)
                        lat[f"edge_exec_{side}"] += await round_trips(eex, n_exec // 3, w)
                        lat[f"edge_replay_{side}"] += await round_trips(replay, n_replay // 3,
                                                                        1 if w else 0)
                for sb in (lsb, rsb, quiet):
                    await sb.delete()
            await remote.close()
        for name, xs in lat.items():
            out.update(latency_ms(xs, f"{name}_"))
        for w in WORKLOADS:
            out[f"{w}_remote_over_local_p50"] = ratio(out[f"{w}_remote_p50_ms"],
                                                      out[f"{w}_local_p50_ms"])
        out["loadavg_end"] = os.getloadavg()
    finally:
        keys.close()
        await edge.close(destroy=True)
        events.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(quick: bool = False, json_out: bool = False) -> dict[str, Any]:
    res = asyncio.run(bench(quick))
    if not json_out:
        for w in WORKLOADS:
            say(f"{w:14s} local p50 {res[f'{w}_local_p50_ms']:8.2f} ms  remote p50 "
                f"{res[f'{w}_remote_p50_ms']:8.2f} ms  ratio {res[f'{w}_remote_over_local_p50']}")
    return emit(res, json_out)
