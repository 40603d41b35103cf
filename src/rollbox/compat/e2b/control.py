"""E2B's REST control plane (``/sandboxes``, ``/v2/sandboxes``) on rollbox's placement.

Answers use E2B's shapes and errors (``{"code": <status>, "message": ...}``); template builds,
volumes, metrics, logs and anything else rollbox does not offer answer 501, never hang.
"""
from __future__ import annotations

import datetime as dt
import ipaddress
import json
import logging
import re
import urllib.parse
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from rollbox import errors
from rollbox.api.context import ApiContext
from rollbox.compat.e2b.state import (
    CLIENT_ID,
    ENVD_VERSION,
    E2B_USER,
    TEMPLATE_LABEL,
    USER_LABEL,
    E2BState,
    iso,
    labels_of,
    metadata_of,
    now,
)
from rollbox.default_images import E2B_BASE_IMAGE
from rollbox.edge.interface import EdgeAPI
from rollbox.iam import Principal
from rollbox.models import (
    MAX_FORK_CHILDREN,
    MAX_TIMEOUT_S,
    NETWORK_MAX_RULES,
    ForkSpec,
    NetworkPolicy,
    SandboxInfo,
    SandboxSpec,
    SnapshotSpec,
)

log = logging.getLogger(__name__)

PREFIX = "/e2b"
DEFAULT_TIMEOUT_S = 15  # E2B's server default when a create names none
NOW_S = 0.001  # a timeout of 0: the TTL ends now
LIST_LIMIT_MAX = 1000


# rollbox states an E2B sandbox can be in (E2B knows only "running" and "paused").
LIVE_STATES = ("creating", "running", "paused")


def e2b_state(info: SandboxInfo) -> str:
    return "paused" if info.state == "paused" else "running"


def e2b_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _from_exc(exc: Exception) -> JSONResponse:
    if isinstance(exc, errors.SandboxDead):
        return e2b_error(404, str(exc))  # gone: E2B says "not found"
    if isinstance(exc, errors.RollboxError):
        return e2b_error(exc.status, str(exc))
    if isinstance(exc, ValidationError):
        return e2b_error(400, "; ".join(
            f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}"
            for e in exc.errors()))
    log.error("e2b control call failed", exc_info=exc)
    return e2b_error(500, "internal error")


def _timeout(value: Any, default: float | None = None) -> float:
    if value is None:
        if default is None:
            raise errors.BadRequest("timeout is required")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise errors.BadRequest("timeout must be a number of seconds")
    if not 0 < value <= MAX_TIMEOUT_S:
        raise errors.BadRequest(f"timeout must be in (0, {MAX_TIMEOUT_S}]")
    return float(value)


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MICRO = dt.timedelta(microseconds=1)


def _micros(ts: float | dt.datetime) -> int:
    """Microseconds since the epoch, exactly as ``iso()`` reports a time (startedAt): a
    filter by a reported time then includes that sandbox, whatever float rounding says."""
    when = ts if isinstance(ts, dt.datetime) else dt.datetime.fromtimestamp(ts, dt.UTC)
    return (when - _EPOCH) // _MICRO


def _started_after(raw: str | None) -> int | None:
    """``startedAfter`` (RFC 3339) in microseconds since the epoch."""
    if not raw:
        return None
    try:
        ts = dt.datetime.fromisoformat(raw.replace("Z", "+00:00").replace(" ", "+"))
    except ValueError:
        raise errors.BadRequest(f"startedAfter is not an RFC 3339 time: {raw[:64]!r}") from None
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=dt.UTC)
    return _micros(ts)


def _cursor(raw: str | None) -> tuple[float, str] | None:
    """A list page's ``nextToken``: ``<created_at>:<id>`` of the previous page's last item, so
    a page never repeats or skips a sandbox when others come and go in between."""
    if not raw:
        return None
    at, _, sid = raw.partition(":")
    try:
        return float(at), sid
    except ValueError:
        raise errors.BadRequest(f"invalid nextToken {raw[:64]!r}") from None


OUT_PORTS = (80, 443)  # what an E2B allowOut entry opens (rollbox rules name their ports)
MAX_DNS_SERVERS = 10  # E2B's cap
ALL_TRAFFIC = ipaddress.IPv4Network("0.0.0.0/0")
DOMAIN_RE = re.compile(r"(\*\.)?[a-z0-9_-]+(\.[a-z0-9_-]+)*\.[a-z][a-z0-9-]*")


def open_outside(deny: list[ipaddress.IPv4Network]) -> list[ipaddress.IPv4Network]:
    """The IPv4 space minus ``deny``, as the fewest CIDRs (E2B's "everything but denyOut")."""
    open_nets = [ALL_TRAFFIC]
    for d in deny:
        nxt: list[ipaddress.IPv4Network] = []
        for o in open_nets:
            if not o.overlaps(d):
                nxt.append(o)
            elif o.subnet_of(d):
                continue
            else:  # d inside o
                nxt.extend(o.address_exclude(d))
        open_nets = nxt
    return list(ipaddress.collapse_addresses(open_nets))


def _is_domain(entry: str) -> bool:
    try:
        ipaddress.IPv4Network(entry.strip(), strict=False)
    except ValueError:
        return DOMAIN_RE.fullmatch(entry.strip().lower()) is not None
    return False


def _deny_nets(deny: list[str]) -> list[ipaddress.IPv4Network]:
    out = []
    for d in deny:
        text = d.strip()
        try:
            out.append(ipaddress.IPv4Network(text, strict=True))
        except ValueError as exc:
            if _is_domain(text):
                raise errors.NotSupported(
                    f"network.denyOut of a domain name ({text[:100]!r}) is not supported by "
                    "rollbox (nor by E2B: deny rules are CIDRs or addresses)") from None
            raise errors.BadRequest(f"network.denyOut: {text[:100]!r} is not an IPv4 CIDR or "
                                    f"address ({exc})") from None
    return out


def _network(body: dict[str, Any]) -> NetworkPolicy | None:
    """E2B's egress rules onto rollbox's network policy (default deny, allow rules only):

    - each ``allowOut`` entry (CIDR, address or domain, ``*.`` wildcards) opens tcp 80 and 443
      to it; no allowOut and no denyOut: no network (rollbox's default);
    - ``denyOut`` (CIDRs or addresses, as E2B takes them) means "everything else": the IPv4
      space minus the denied ranges opens on tcp 80 and 443 as CIDR rules, besides allowOut
      (E2B: allowed entries take precedence over denied ones). ``0.0.0.0/0`` leaves allowOut
      alone. The policy's forbidden ranges (host, other sandboxes, link-local) stay closed;
    - ``dnsServers`` (IPv4, at most 10), when allowOut names a domain: udp and tcp 53 to each
      (omitted: none; rollbox's DNS gate answers the allowed names);
    - ``rules`` (request transforms), ``egressProxy`` and ``maskRequestHost``: 501."""
    net = body.get("network") or {}
    if not isinstance(net, dict):
        raise errors.BadRequest("network must be an object")
    for k, what in (("rules", "per-domain request transforms"), ("egressProxy", "egress proxy"),
                    ("maskRequestHost", "request host masks")):
        if net.get(k):
            raise errors.NotSupported(f"network.{k} ({what}) is not supported by rollbox")
    allow, deny = net.get("allowOut") or [], net.get("denyOut") or []
    dns = net.get("dnsServers") or []
    if not isinstance(allow, list) or not isinstance(deny, list) or not isinstance(
            dns, list) or not all(isinstance(x, str) for x in [*allow, *deny, *dns]):
        raise errors.BadRequest("network.allowOut, network.denyOut and network.dnsServers "
                                "must be lists of strings")
    if len(dns) > MAX_DNS_SERVERS:
        raise errors.BadRequest(f"network.dnsServers: at most {MAX_DNS_SERVERS} entries")
    rules = [f"{a.strip()}:{p}/tcp" for a in allow for p in OUT_PORTS]
    if deny:
        rules += [f"{n}:{p}/tcp" for n in open_outside(_deny_nets(deny)) for p in OUT_PORTS]
    if any(_is_domain(a) for a in allow):
        for d in dns:
            try:
                ip = ipaddress.IPv4Address(d.strip())
            except ValueError:
                raise errors.BadRequest(f"network.dnsServers: {d[:64]!r} is not an IPv4 "
                                        "address") from None
            rules += [f"{ip}:53/udp", f"{ip}:53/tcp"]
    if not rules:
        return None
    if len(rules) > NETWORK_MAX_RULES:
        raise errors.BadRequest(f"network: {len(rules)} rules (allowOut and the ranges denyOut "
                                f"leaves open, each on 2 ports) is above rollbox's "
                                f"{NETWORK_MAX_RULES}", limit=NETWORK_MAX_RULES)
    try:
        return NetworkPolicy(allow=rules)
    except ValidationError as exc:
        raise errors.BadRequest(f"network.allowOut: {exc.errors()[0].get('msg')}") from None


async def _json(request: Request) -> dict[str, Any]:
    body = await request.body()
    if not body:
        return {}
    try:
        msg = json.loads(body)
    except ValueError:
        raise errors.BadRequest("body is not JSON") from None
    if not isinstance(msg, dict):
        raise errors.BadRequest("body must be a JSON object")
    return msg


def mount_control(app: FastAPI, api: ApiContext, state: E2BState) -> None:
    async def who(request: Request) -> Principal:
        key = request.headers.get("x-api-key")
        if not key:
            auth = request.headers.get("authorization", "")
            key = auth[7:] if auth.lower().startswith("bearer ") else None
        return await api.principal(key)

    async def live(sid: str, principal: Principal) -> tuple[EdgeAPI, SandboxInfo]:
        edge = await api.sandbox_edge(sid, principal)
        info = await edge.get(sid)
        if info.state not in LIVE_STATES:
            raise errors.NotFound(f"sandbox {sid} not found ({info.state})")
        return edge, info

    def template_of(info: SandboxInfo) -> str:
        return info.labels.get(TEMPLATE_LABEL, info.image)

    # get_host(port) is "{port}-{id}.{domain}": the api's per-sandbox origins (api.ports).
    port_domain = app.state.port_config.domain

    def sandbox_json(info: SandboxInfo, principal: Principal) -> dict[str, Any]:
        t = template_of(info)
        return {"clientID": CLIENT_ID, "envdVersion": ENVD_VERSION, "sandboxID": info.id,
                "templateID": t, "alias": t, "domain": port_domain,
                "envdAccessToken": state.token(info.id, principal.key_id)}

    def listed_json(info: SandboxInfo) -> dict[str, Any]:
        t = template_of(info)
        return {
            "clientID": CLIENT_ID, "envdVersion": ENVD_VERSION, "sandboxID": info.id,
            "templateID": t, "alias": t, "metadata": metadata_of(info),
            "cpuCount": max(1, round(info.resources.cpus)),
            "memoryMB": info.resources.memory_mib, "diskSizeMB": info.resources.disk_mib,
            "startedAt": iso(info.created_at), "endAt": iso(info.expires_at),
            "state": e2b_state(info),
            "lifecycle": {"autoResume": info.resume_on_traffic,
                          "onTimeout": "pause" if info.on_expiry == "pause" else "kill"},
            # what a paused sandbox's pause kept: "full" (frozen, memory kept) or
            # "filesystem" (stopped; a resume boots it again)
            **({"pauseMode": "full" if info.memory_kept else "filesystem"}
               if info.state == "paused" else {}),
        }

    def handler(fn):
        async def wrapped(request: Request) -> Response:
            try:
                return await fn(request)
            except Exception as exc:  # noqa: BLE001
                return _from_exc(exc)

        wrapped.__name__ = f"e2b_{fn.__name__}"
        return wrapped

    @handler
    async def create(request: Request) -> Response:
        principal = await who(request)
        body = await _json(request)
        template = body.get("templateID")
        if not isinstance(template, str) or not template:
            raise errors.BadRequest("templateID is required")
        if body.get("mcp"):
            return e2b_error(501, "MCP gateways are not supported by rollbox")
        # autoPause: the TTL's end pauses it (rollbox's on_expiry "pause"): frozen in place
        # (memory kept), or with autoPauseMemory=false filesystem-only (pause_keep_memory
        # False: stopped, files kept; a resume boots it again)
        fs_only = bool(body.get("autoPause")) and body.get("autoPauseMemory") is False
        # autoResume: traffic to it while paused (a port, envd) resumes it first, with its
        # timeout again (rollbox's resume_on_traffic)
        resume_cfg = body.get("autoResume") or {}
        if not isinstance(resume_cfg, dict):
            raise errors.BadRequest("autoResume must be an object")
        auto_resume = bool(resume_cfg.get("enabled"))
        if auto_resume and not body.get("autoPause"):
            raise errors.BadRequest("autoResume needs autoPause (on_timeout pause)")
        if auto_resume and fs_only:  # as E2B: traffic would reach a sandbox still booting
            raise errors.BadRequest("autoResume can not be combined with a filesystem-only "
                                    "auto-pause (autoPauseMemory=false): resume it by connect")
        metadata = body.get("metadata") or {}
        envs = body.get("envVars") or {}
        if not isinstance(metadata, dict) or not isinstance(envs, dict):
            raise errors.BadRequest("metadata and envVars must be objects")
        image = state.image_of(template)
        labels = labels_of(metadata, template)
        if image == E2B_BASE_IMAGE:  # E2B's base: commands and paths default to `user`
            labels[USER_LABEL] = E2B_USER
        spec = SandboxSpec(image=image, ttl_s=_timeout(body.get("timeout"), DEFAULT_TIMEOUT_S),
                           labels=labels, env=envs, network=_network(body),
                           on_expiry="pause" if body.get("autoPause") else "delete",
                           resume_on_traffic=auto_resume, pause_keep_memory=not fs_only)
        info = await api.create_sandbox(spec, principal.project, requested={
            "op": "create", "by": principal.key_id, "labels": spec.labels,
            "resources": spec.resources.model_dump(), "ttl_s": spec.ttl_s, "via": "e2b",
        })
        api.remember_owner(info.id, principal.project)
        return JSONResponse(sandbox_json(info, principal), status_code=201)

    async def _list(request: Request, paged: bool) -> Response:
        principal = await who(request)
        q = request.query_params
        wanted: dict[str, str] = {}
        raw = q.get("metadata")
        if raw:
            for k, v in urllib.parse.parse_qsl(raw, keep_blank_values=True):
                wanted[urllib.parse.unquote(k)] = urllib.parse.unquote(v)
        states = {s for s in (q.get("state") or "running,paused").split(",") if s}
        if states - {"running", "paused"}:
            raise errors.BadRequest(f"unknown state in {q.get('state')!r}")
        order = q.get("order") or ("desc" if paged else "asc")
        if order not in ("asc", "desc"):
            raise errors.BadRequest(f"order must be 'asc' or 'desc', not {order!r}")
        started_after = _started_after(q.get("startedAfter"))
        template = q.get("template")
        labels = {}
        for k, v in wanted.items():
            labels.update({lk: lv for lk, lv in labels_of({k: v}, "").items()
                           if lk != TEMPLATE_LABEL})
        owner = None if principal.admin else principal.project
        found = [i for i in await api.list_sandboxes(owner, labels)
                 if (owner is None or i.owner == owner)
                 and all(i.labels.get(k) == v for k, v in labels.items())
                 and i.state in LIVE_STATES
                 and e2b_state(i) in states
                 # startedAt is reported to the microsecond: compare at that precision
                 and (started_after is None or _micros(i.created_at) >= started_after)
                 and (not template or template in (template_of(i), i.image))]
        found.sort(key=lambda i: (i.created_at, i.id), reverse=order == "desc")
        headers = {}
        if paged:
            try:
                limit = int(q.get("limit") or 100)
            except ValueError:
                raise errors.BadRequest("limit must be an integer") from None
            if not 1 <= limit <= LIST_LIMIT_MAX:
                raise errors.BadRequest(f"limit must be in 1..{LIST_LIMIT_MAX}")
            after = _cursor(q.get("nextToken"))
            if after is not None:  # the page starts past the last item of the previous one
                found = [i for i in found if ((i.created_at, i.id) > after if order == "asc"
                                              else (i.created_at, i.id) < after)]
            if len(found) > limit:
                last = found[limit - 1]
                headers["x-next-token"] = f"{last.created_at!r}:{last.id}"
            found = found[:limit]
        return JSONResponse([listed_json(i) for i in found], headers=headers)

    @handler
    async def list_v1(request: Request) -> Response:
        return await _list(request, paged=False)

    @handler
    async def list_v2(request: Request) -> Response:
        return await _list(request, paged=True)

    @handler
    async def get(request: Request) -> Response:
        sid = request.path_params["sandbox_id"]
        principal = await who(request)
        _, info = await live(sid, principal)
        return JSONResponse({**listed_json(info),
                             "envdAccessToken": state.token(sid, principal.key_id)})

    @handler
    async def kill(request: Request) -> Response:
        principal = await who(request)
        sid = request.path_params["sandbox_id"]
        edge = await api.sandbox_edge(sid, principal)
        if (await edge.get(sid)).state in ("stopping", "deleted"):
            raise errors.NotFound(f"sandbox {sid} not found")  # kill twice: E2B says 404
        await api.delete_sandbox(edge, sid,  # the edge logs sandbox.deleted
                                 {"op": "delete", "by": principal.key_id, "via": "e2b"})
        return Response(status_code=204)

    @handler
    async def set_timeout(request: Request) -> Response:
        sid = request.path_params["sandbox_id"]
        edge, info = await live(sid, await who(request))
        raw = (await _json(request)).get("timeout")
        # E2B: 0 ends it now (killed, or paused when it auto-pauses); the edge's TTL loop
        # does that within a second
        ttl = NOW_S if raw == 0 and not isinstance(raw, bool) else _timeout(raw)
        if info.state != "paused":  # a paused sandbox keeps its pause TTL until resumed
            await edge.set_ttl(sid, ttl)
        return Response(status_code=204)

    @handler
    async def refresh(request: Request) -> Response:
        sid = request.path_params["sandbox_id"]
        edge, info = await live(sid, await who(request))
        ttl = _timeout((await _json(request)).get("duration"), 60)
        if now() + ttl > info.expires_at and info.state != "paused":
            await edge.set_ttl(sid, ttl)
        return Response(status_code=204)

    @handler
    async def pause(request: Request) -> Response:
        sid = request.path_params["sandbox_id"]
        edge, info = await live(sid, await who(request))
        if info.state == "paused":
            return e2b_error(409, f"sandbox {sid} is already paused")
        memory = (await _json(request)).get("memory", True)
        if not isinstance(memory, bool):
            raise errors.BadRequest("memory must be a boolean")
        # Paused = frozen by the edge (agent and every process stop; memory and files kept),
        # or with memory=false stopped (filesystem only: a resume boots it again); envd calls
        # are refused until a connect/resume. Like E2B, a paused sandbox does not expire at
        # its running timeout: it lives on for up to paused_ttl_s.
        await edge.pause(sid, keep_memory=memory)
        await edge.set_ttl(sid, state.paused_ttl_s)
        return Response(status_code=204)

    async def _resume(request: Request, must_be_paused: bool) -> Response:
        sid = request.path_params["sandbox_id"]
        principal = await who(request)
        edge, info = await live(sid, principal)
        body = await _json(request)
        ttl = _timeout(body.get("timeout"), 300)
        memory = body.get("memory", True)
        if not isinstance(memory, bool):
            raise errors.BadRequest("memory must be a boolean")
        if info.state == "paused":
            if not memory and info.memory_kept:  # from disk only: its memory is dropped
                await edge.pause(sid, keep_memory=False)
            info = await edge.resume(sid)
            await edge.set_ttl(sid, ttl)
            return JSONResponse(sandbox_json(info, principal), status_code=201)
        if must_be_paused:
            return e2b_error(409, f"sandbox {sid} is already running")
        if now() + ttl > info.expires_at:  # connect only ever extends a running sandbox
            await edge.set_ttl(sid, ttl)
        return JSONResponse(sandbox_json(info, principal), status_code=200)

    @handler
    async def connect(request: Request) -> Response:
        return await _resume(request, must_be_paused=False)

    @handler
    async def resume(request: Request) -> Response:
        return await _resume(request, must_be_paused=True)

    @handler
    async def fork(request: Request) -> Response:
        """E2B's fork onto rollbox's (POST /v1/sandboxes/{id}/fork): ``count`` children with
        the source's files, env, metadata and template; each gets the request's ``timeout``
        (E2B's default 15 s). rollbox forks all or none: a refusal is the whole answer's."""
        sid = request.path_params["sandbox_id"]
        principal = await who(request)
        edge, src = await live(sid, principal)
        body = await _json(request)
        count = body.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not \
                1 <= count <= MAX_FORK_CHILDREN:
            raise errors.BadRequest(f"count must be an integer in 1..{MAX_FORK_CHILDREN}")
        ttl = _timeout(body.get("timeout"), DEFAULT_TIMEOUT_S)
        if src.job is not None:  # NotFound unless the project's job is still live
            await api.lease_store().live(src.owner, src.job)
        result = await api.fork_sandbox(edge, sid, ForkSpec(n=count), src.owner,
                                        src.resources)
        out = []
        for child in result.children:
            api.remember_owner(child.id, src.owner)
            child = await edge.set_ttl(child.id, ttl)
            out.append({"sandbox": sandbox_json(child, principal)})
        if api.watcher is not None:
            api.watcher.remember(result.children)
        await api.record(edge, sid, "sandbox.requested", {
            "op": "fork", "by": principal.key_id, "n": count, "via": "e2b",
            "children": [c.id for c in result.children]})
        return JSONResponse(out, status_code=201)

    @handler
    async def snapshot(request: Request) -> Response:
        """E2B's snapshot onto rollbox's (pack_diff of the writable layer into an image of the
        project): the snapshot id is the image's name, a template name for later creates."""
        sid = request.path_params["sandbox_id"]
        edge, src = await live(sid, await who(request))
        name = (await _json(request)).get("name") or f"{src.owner}/e2b-snap-{sid}-{int(now())}"
        if not isinstance(name, str) or not 1 <= len(name) <= 200:
            raise errors.BadRequest("name must be a string of 1..200 characters")
        await api.check_image_name(src.owner, name)
        res = await edge.snapshot(sid, SnapshotSpec(name=name), src.owner)
        return JSONResponse({"snapshotID": res.image, "names": [res.image]}, status_code=201)

    @handler
    async def metrics(request: Request) -> Response:
        """E2B's metrics from rollbox's usage (GET /v1/sandboxes/{id}/usage): one entry per
        sample in [start, end] (unix seconds), CPU % of the sandbox's CPUs between samples."""
        sid = request.path_params["sandbox_id"]
        edge, info = await live(sid, await who(request))
        q = request.query_params
        try:
            start = float(q["start"]) if q.get("start") else None
            end = float(q["end"]) if q.get("end") else None
        except ValueError:
            raise errors.BadRequest("start and end are unix seconds") from None
        samples = await edge.usage_history(sid)
        cpus = max(1, round(info.resources.cpus))
        out = []
        for prev, cur in zip([None, *samples], samples, strict=False):
            if (start is not None and cur.at < start) or (end is not None and cur.at > end):
                continue
            pct = 0.0
            if prev is not None and cur.at > prev.at and cur.cpu_usage_us is not None \
                    and prev.cpu_usage_us is not None:
                pct = (cur.cpu_usage_us - prev.cpu_usage_us) / 1e6 / (cur.at - prev.at) \
                    / cpus * 100
            out.append({"timestamp": iso(cur.at), "timestampUnix": int(cur.at),
                        "cpuCount": cpus, "cpuUsedPct": round(max(0.0, pct), 2),
                        "memUsed": cur.memory_bytes or 0,
                        "memTotal": info.resources.memory_mib << 20, "memCache": 0,
                        "diskUsed": cur.disk_bytes or 0,
                        "diskTotal": info.resources.disk_mib << 20})
        return JSONResponse(out)

    @handler
    async def update_network(request: Request) -> Response:
        sid = request.path_params["sandbox_id"]
        edge, _ = await live(sid, await who(request))
        await edge.set_network(sid, _network({"network": await _json(request)}))
        return Response(status_code=204)

    one = "/sandboxes/{sandbox_id}"
    routes = [  # (method, path under /e2b, handler)
        ("POST", "/sandboxes", create), ("POST", "/v2/sandboxes", create),
        ("GET", "/sandboxes", list_v1), ("GET", "/v2/sandboxes", list_v2),
        ("GET", one, get), ("DELETE", one, kill),
        ("POST", one + "/timeout", set_timeout), ("POST", one + "/refreshes", refresh),
        ("POST", one + "/pause", pause), ("POST", one + "/resume", resume),
        ("POST", one + "/connect", connect), ("POST", "/v2" + one + "/connect", connect),
        ("POST", one + "/fork", fork), ("POST", one + "/snapshots", snapshot),
        ("GET", one + "/metrics", metrics), ("PUT", one + "/network", update_network),
    ]
    for method, path, fn in routes:
        app.add_api_route(PREFIX + path, fn, methods=[method], include_in_schema=False)

def mount_fallback(app: FastAPI, api: ApiContext) -> None:
    """Anything else under /e2b (mounted last): 501 for an authenticated caller."""

    async def unsupported(request: Request) -> Response:
        try:
            key = request.headers.get("x-api-key") or request.headers.get("x-access-token")
            if request.headers.get("x-access-token") is None:
                await api.principal(key)
        except errors.RollboxError as exc:
            return _from_exc(exc)
        path = request.url.path[len(PREFIX):]
        if path.startswith(("/templates", "/v2/templates", "/v3/templates")):
            what = "template builds and template management are"
        elif path.startswith("/volumes"):
            what = "volumes are"
        else:
            what = f"{request.method} {path} is"
        return e2b_error(501, f"{what} not supported by rollbox's E2B API")

    app.add_api_route(PREFIX + "/{rest:path}", unsupported,
                      methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
