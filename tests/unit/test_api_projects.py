"""The projects, keys and quota routes over the SDK and the CLI, with the quota ledger on the
create path (in-process api over fake edges: the routes and the create path are what is under
test; the stores run for real, SQLite)."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.models import Quota
from tests.unit.test_api_support import ApiStack


async def test_nested_projects_keys_and_quotas_over_the_api(tmp_path: Path) -> None:
    async with ApiStack(tmp_path, nodes=("n0", "n1"), ledger=True) as s, \
            s.client(s.admin_key) as op:
        team = await op.create_project("team", sandboxes=4, cpus=8, memory_mib=8192)
        assert team.parent is None and team.quota.sandboxes == 4
        team_admin = (await op.create_key("team", admin=True)).key
        async with s.client(team_admin) as ta:
            sub = await ta.create_project("run", parent="team", sandboxes=3, cpus=3,
                                          memory_mib=3072)
            assert sub.name == "team/run"
            created = await ta.create_key("team/run")
            assert created.info.project == "team/run" and not created.info.admin
            assert created.key not in json.dumps([k.model_dump() for k in await ta.keys()])
            # Bad input: each typed, nothing made.
            for call, error in (
                    (ta.create_project("team/big", sandboxes=2, cpus=0, memory_mib=0),
                     errors.BadRequest),  # 3 + 2 > 4
                    (ta.create_project("team/x", sandboxes=-1, cpus=0, memory_mib=0),
                     errors.BadRequest),
                    (ta.create_project("team/no/x"), errors.NotFound),
                    (ta.create_project("team/bad name"), errors.BadRequest),
                    (ta.create_project("x", parent="team/run/"), errors.BadRequest),
                    (ta.create_project("other"), errors.Forbidden),
                    (ta.create_key("proj-a"), errors.Forbidden),
                    (ta.create_key("team/none"), errors.NotFound),
                    (ta.set_project_quota("team", sandboxes=100), errors.Forbidden),
                    (ta.set_project_quota("team/run", sandboxes=5, cpus=3, memory_mib=3072),
                     errors.BadRequest)):
                with pytest.raises(error):
                    await call
            assert [p.name for p in await ta.projects()] == ["team", "team/run"]
            assert [p.name for p in await op.projects()] == [
                "ops", "proj-a", "proj-b", "team", "team/run"]

        async with s.client(created.key) as run:
            # team/run holds 3 sandboxes: the fourth create is refused before any edge is
            # asked, and the error names team/run alone.
            made = [await run.create("img", cpus=1, memory_mib=512) for _ in range(3)]
            creates = sum(e.creates for e in s.edges)
            with pytest.raises(errors.QuotaExceeded) as exc:
                await run.create("img", cpus=1, memory_mib=512)
            assert exc.value.details["project"] == "team/run"
            assert "'team'" not in str(exc.value) and "ops" not in str(exc.value)
            assert sum(e.creates for e in s.edges) == creates
            assert [p.name for p in await run.projects()] == ["team/run"]
            info = (await run.projects())[0]
            assert info.used.sandboxes == 3 and info.used.memory_mib == 1536
            with pytest.raises(errors.Forbidden):
                await run.project_quota("team")
            with pytest.raises(errors.Forbidden):
                await run.keys()
            await made[0].delete()
            await run.create("img", cpus=1, memory_mib=512)
            for sb in await run.list():
                await sb.delete()
            assert (await run.projects())[0].used.sandboxes == 0
        assert s.ledger is not None
        assert (await s.ledger.usage("team")).sandboxes == 0


async def test_a_failed_or_cancelled_create_gives_its_room_back(tmp_path: Path) -> None:
    async with ApiStack(tmp_path, ledger=True) as s, s.client(s.admin_key) as op:
        await op.create_project("p", sandboxes=1)
        key = (await op.create_key("p")).key
        assert s.ledger is not None
        async with s.client(key) as c:
            s.edges[0].inject["create"] = errors.InfraError("edge broke")
            with pytest.raises(errors.InfraError):
                await c.create("img")
            assert (await s.ledger.usage("p")).sandboxes == 0
            del s.edges[0].inject["create"]
            await s.poll()  # the node that refused is a candidate again
            gate = asyncio.Event()
            orig = s.edges[0].create

            async def slow(spec, owner, **kw):  # noqa: ANN001, ANN003, ANN202
                await gate.wait()
                return await orig(spec, owner, **kw)

            s.edges[0].create = slow  # type: ignore[method-assign]
            api = s.app.state.api
            from rollbox.models import SandboxSpec

            task = asyncio.create_task(api.create_sandbox(SandboxSpec(image="img"), "p"))
            await asyncio.sleep(0.1)
            assert (await s.ledger.usage("p")).sandboxes == 1  # reserved while it runs
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.05)
            assert (await s.ledger.usage("p")).sandboxes == 0
            gate.set()
            s.edges[0].create = orig  # type: ignore[method-assign]
            sb = await c.create("img")
            await sb.delete()


async def test_keys_in_e2b_form_act_for_their_project(tmp_path: Path) -> None:
    """``format="e2b"``: ``e2b_`` + hex (the form E2B's SDKs check), same powers as rbx_ keys:
    it authenticates, sees only its project, and is refused once revoked; a bad format is
    bad_request."""
    import re

    from typer.testing import CliRunner

    from rollbox.cli import app as cli_app

    async with ApiStack(tmp_path, ledger=True) as s, s.client(s.admin_key) as op:
        created = await op.create_key("e2bp", format="e2b")
        assert re.fullmatch(r"e2b_[0-9a-f]{64}", created.key), created.key
        assert created.info.display.startswith("e2b_") and created.key not in created.info.display
        other = (await op.create_key("elsewhere")).key
        async with s.client(other) as c2, s.client(created.key) as c:
            theirs = await c2.create("img")
            mine = await c.create("img")
            assert [sb.id for sb in await c.list()] == [mine.id]
            await mine.delete()
            await theirs.delete()
        with pytest.raises(errors.BadRequest):
            await op._t.request("POST", "/v1/keys", json={"project": "e2bp", "format": "x"})
        await op.revoke_key(created.info.key_id)
        async with s.client(created.key) as c:
            with pytest.raises(errors.Unauthorized):
                await c.list()
        async with s.client("e2b_" + "0" * 64) as c:  # well formed, never issued
            with pytest.raises(errors.Unauthorized):
                await c.list()
        env = {"ROLLBOX_API_KEY": s.admin_key, "ROLLBOX_URL": s.url}
        res = await asyncio.to_thread(CliRunner().invoke, cli_app,
                                      ["key", "create", "--project", "e2bp", "--format", "e2b"],
                                      env=env)
        assert res.exit_code == 0 and re.fullmatch(r"e2b_[0-9a-f]{64}", res.output.strip())
        res = await asyncio.to_thread(CliRunner().invoke, cli_app,
                                      ["key", "create", "--project", "e2bp", "--format", "x"],
                                      env=env)
        assert res.exit_code == 2 and "bad_request" in res.output, res.output


async def test_the_cli_creates_lists_and_sets_projects(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from rollbox.cli import app as cli_app

    async with ApiStack(tmp_path, ledger=True) as s:
        env = {"ROLLBOX_API_KEY": s.admin_key, "ROLLBOX_URL": s.url}
        runner = CliRunner()

        async def cli(*args: str) -> tuple[int, str]:
            res = await asyncio.to_thread(runner.invoke, cli_app, list(args), env=env)
            return res.exit_code, res.output

        code, out = await cli("project", "create", "lab", "--sandboxes", "5", "--cpus", "5",
                              "--memory-mib", "5000")
        assert code == 0 and json.loads(out)["quota"]["sandboxes"] == 5, out
        code, out = await cli("project", "create", "one", "--parent", "lab", "--sandboxes",
                              "6", "--cpus", "1", "--memory-mib", "1")
        assert code == 2 and "bad_request" in out, out
        code, out = await cli("project", "create", "lab/one", "--sandboxes", "2", "--cpus",
                              "2", "--memory-mib", "2000")
        assert code == 0, out
        code, out = await cli("project", "ls", "--json")
        assert code == 0 and {"lab", "lab/one"} <= {p["name"] for p in json.loads(out)}
        code, out = await cli("project", "quota", "lab/one", "--sandboxes", "3")
        assert code == 0 and json.loads(out)["sandboxes"] == 3, out
        code, out = await cli("key", "create", "--project", "lab/one", "--admin")
        assert code == 0 and out.strip().startswith("rbx_"), out
        sub_admin = out.strip()
        env["ROLLBOX_API_KEY"] = sub_admin
        code, out = await cli("key", "create", "--project", "lab")
        assert code == 2 and "forbidden" in out, out
        code, out = await cli("project", "ls")
        assert code == 0 and "lab/one" in out and "lab " not in out.replace("lab/one", ""), out
        assert s.keys.get("lab/one") == Quota(sandboxes=3, cpus=2, memory_mib=2000)


async def test_a_quota_holds_across_three_nodes(tmp_path: Path) -> None:
    """Cluster-wide, not per node: 5 sandboxes in all, wherever placement put them."""
    async with ApiStack(tmp_path, nodes=("n0", "n1", "n2"), ledger=True) as s, \
            s.client(s.admin_key) as op:
        await op.create_project("wide", sandboxes=5)
        key = (await op.create_key("wide")).key
        async with s.client(key) as c:
            async def one() -> bool:
                try:
                    await c.create("img")
                    return True
                except errors.QuotaExceeded:
                    return False

            assert sum(await asyncio.gather(*(one() for _ in range(30)))) == 5
            assert sum(len(e.sandboxes) for e in s.edges) == 5
            for sb in await c.list():
                await sb.delete()
        assert s.ledger is not None and (await s.ledger.usage("wide")).sandboxes == 0


async def test_quota_values_a_column_can_not_hold_are_bad_request(tmp_path: Path) -> None:
    """Below an unlimited parent nothing bounds a child's limit but the model: an int over
    64 bits was an OverflowError out of SQLite (500 internal), and Infinity (raw JSON) was
    stored as an unbounded limit; both are bad_request now and nothing is made."""
    import aiohttp

    async with ApiStack(tmp_path, ledger=True) as s, s.client(s.admin_key) as op:
        await op.create_project("top")  # unlimited
        for kw in ({"sandboxes": 10**30}, {"memory_mib": 2**63}, {"layer_mib": 2**64}):
            with pytest.raises(errors.BadRequest):
                await op.create_project("c", parent="top", **kw)
            with pytest.raises(errors.BadRequest):
                await op.set_project_quota("top", **kw)
        headers = {"Authorization": f"Bearer {s.admin_key}",
                   "Content-Type": "application/json"}
        async with aiohttp.ClientSession() as http:
            for raw in ('{"cpus": Infinity}', '{"cpus": NaN}', '{"cpus": 1e400}'):
                async with http.put(f"{s.url}/v1/projects/top/quota", data=raw,
                                    headers=headers) as resp:
                    assert resp.status in (400, 422), raw
                    assert (await resp.json())["error"]["code"] == "bad_request"
                async with http.post(f"{s.url}/v1/projects", headers=headers,
                                     data='{"name": "top/c", "quota": %s}' % raw) as resp:
                    assert resp.status in (400, 422), raw
        assert [p.name for p in await op.projects() if p.name.startswith("top")] == ["top"]
        assert (await op.project_quota("top")).cpus is None


async def test_a_retried_keyed_create_racing_a_delete_is_charged(tmp_path: Path) -> None:
    """A retry (X-Rollbox-Attempt 2) of a keyed create found the earlier sandbox in a list and
    asked its edge to create under the key; if a delete took it between the two, the edge made
    a new sandbox that no ledger reservation held (a project at its quota of 1 then held 2).
    Now that one is deleted again and the retry creates through the ledger."""
    import aiohttp

    async with ApiStack(tmp_path, ledger=True) as s, s.client(s.admin_key) as op:
        await op.create_project("p", sandboxes=1)
        key = (await op.create_key("p")).key
        assert s.ledger is not None
        api, edge = s.app.state.api, s.edges[0]
        async with s.client(key) as c:
            first = await c.create("img", idempotency_key="k1")
            orig, raced = edge.create, []

            async def racing(spec, owner, **kw):  # noqa: ANN001, ANN003, ANN202
                if not raced:  # the retry's own call: a delete lands just before it
                    raced.append(True)
                    await edge.delete(first.id)
                    await api.sandbox_ended(first.id)
                return await orig(spec, owner, **kw)

            edge.create = racing  # type: ignore[method-assign]
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{s.url}/v1/sandboxes",
                                     json={"image": "img", "idempotency_key": "k1"},
                                     headers={"Authorization": f"Bearer {key}",
                                              "X-Rollbox-Attempt": "2"}) as resp:
                    assert resp.status == 201, await resp.text()
                    made = (await resp.json())["id"]
            edge.create = orig  # type: ignore[method-assign]
            assert raced and made != first.id
            assert [i.id for i in await edge.list("p", {})] == [made]
            assert (await s.ledger.usage("p")).sandboxes == 1  # the live one is charged
            with pytest.raises(errors.QuotaExceeded):
                await c.create("img")
            await (await c.get(made)).delete()
