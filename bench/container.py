"""``rollbox bench container [--quick] [--json]``.

In one run, against the same image: create -> exec ``true`` -> destroy cycles at concurrency 1,
8 and 32 through the HTTP API (server in its own process, as deployed); exec round trip of
``true`` in a live sandbox; N idle sandboxes held at once, every one answering an exec (host memory
per sandbox: bench/density.py); and the same
create/exec/destroy workload through ``podman --runtime runc run --rm`` as the peer, with ratios;
and ``hardening_overhead``: the c8 cycle rate against a second server whose sandboxes are all
unhardened (no seccomp, Landlock, masks; benchmark-only env switch), as 1 - hardened/unhardened;
and the other runtime (``ROLLBOX_RUNTIME``: runc and native, backends/container/launcher.py):
the c8 cycle and the cold create -> first exec p50 at c1 against a third server that starts its
containers with it, so ``create_exec_destroy_per_s_c8_runc``, ``..._c8_native`` and
``native_vs_runc_c8`` come from one run (``ratio_vs_podman_c8`` is the default runtime's).
And ``observability_overhead`` (issue 18: <= 2 %): c8 rounds against servers with metrics and
JSON logs off and on, alternated (off, on, on, off, ...), the median of the paired ratios.
Every server above has warm pools off (``ROLLBOX_POOL``, default off); the pool's own figures
(``pool_create_p50_ms``, ``pool_create_to_first_exec_p50_ms``) come last, from bench/pool.py.
The last line of ``--json`` is one JSON object.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollbox.benchkit import (
    CpuMeter, cgroup_cpu_s, emit, latency_ms, percentile, process_cpu_s, ratio, record,
    round_trips, rounded, run_cycles, say,
)
from rollbox.config import Settings
from rollbox.embedded import ServerProcess, server_process

# Every server of this benchmark makes its sandboxes cold (its pool figures are bench pool's).
POOL_OFF = {"ROLLBOX_POOL": "off"}
PODMAN_ULIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]


async def cycles(client: Any, image: str, n: int, conc: int) -> dict[str, Any]:
    """create -> exec true -> destroy through the API."""
    first_exec: list[float] = []

    async def cycle() -> bool:
        t = time.monotonic()
        sb = await client.create(image, ttl_s=300)
        r = await sb.exec(["true"])
        first_exec.append(time.monotonic() - t)
        await sb.delete()
        return r.exit_code == 0

    res = await run_cycles(cycle, n, conc)
    record(f"create_to_first_exec_c{conc}", first_exec)
    res["first_exec_p50_ms"] = percentile(first_exec, 50) * 1000
    return res


async def exec_rtt(client: Any, image: str, n: int) -> dict[str, float]:
    async with await client.create(image, ttl_s=300) as sb:
        lat = await round_trips(lambda: sb.exec(["true"]), n)
    return latency_ms(lat, series="exec_round_trip")


async def create_latency(client: Any, image: str, n: int) -> float:
    lat = []
    for _ in range(n):
        t = time.monotonic()
        sb = await client.create(image, ttl_s=300)
        lat.append(time.monotonic() - t)
        await sb.delete()
    return percentile(lat, 50) * 1000


async def idle_density(client: Any, image: str, n: int) -> dict[str, Any]:
    """``n`` idle sandboxes with default resources held at once, every one answering an exec,
    MemAvailable drop / n: ``bench/density.py``'s hold (``rollbox bench density`` runs it at
    3,200 with the node's limits)."""
    from rollbox.benchkit import load_bench

    r = await load_bench("density").hold(client, n, None, Settings().node_id, image=image)
    return {k: r[k] for k in ("idle_sandboxes", "idle_all_answered", "idle_mib_per_sandbox",
                              "idle_slab_kib_per_sandbox", "idle_create_per_s")}


def export_rootfs_tar(image: str, dest: Path) -> None:
    """The image's merged root filesystem as a tar (what podman imports)."""
    from rollbox.images.lazy.mounts import LayerMounts
    from rollbox.images.store import ImageStore
    from rollbox.isolation import syscalls

    store = ImageStore(Settings().images_dir)
    mounts = LayerMounts(store)
    lowers = [str(mounts.ensure_mounted(d)) for d in reversed(store.resolve(image).layers)]
    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "m"
        merged.mkdir()
        if len(lowers) == 1:
            syscalls.mount(lowers[0], merged, None, syscalls.MS_BIND)
        else:
            syscalls.mount("overlay", merged, "overlay", syscalls.MS_RDONLY,
                           f"lowerdir={':'.join(lowers)}")
        try:
            with tarfile.open(dest, "w") as tf:
                tf.add(merged, arcname=".")
        finally:
            syscalls.umount(merged, syscalls.MNT_DETACH)
            mounts.unmount_all()  # layers a running sandbox still uses are skipped


def podman_prepare(image: str) -> str:
    tag = "localhost/rollbox-bench-" + image.replace(":", "-").replace("/", "-")
    with tempfile.TemporaryDirectory() as tmp:
        tar = Path(tmp) / "rootfs.tar"
        export_rootfs_tar(image, tar)
        subprocess.run(["podman", "import", "-q", str(tar), tag], check=True,
                       stdout=subprocess.DEVNULL)
    return tag


async def podman_cycles(tag: str, n: int, conc: int) -> dict[str, Any]:
    """The same cycle through podman (run --rm of the same root filesystem)."""

    async def cycle() -> bool:
        p = await asyncio.create_subprocess_exec(
            "podman", "--runtime", "runc", "run", "--rm", "--network", "none",
            *PODMAN_ULIMITS, tag, "/bin/true",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        return await p.wait() == 0

    return await run_cycles(cycle, n, conc, series="podman_cycle")


async def run(quick: bool, url: str, key: str) -> dict[str, Any]:
    from rollbox.sdk import AsyncClient

    image = "python:3.11"
    ns = {1: 10, 8: 48, 32: 64} if quick else {1: 30, 8: 160, 32: 256}
    idle_n = 200 if quick else 1000
    res: dict[str, Any] = {"image": image, "quick": quick}
    async with AsyncClient(base_url=url, api_key=key, timeout=120) as client:
        await cycles(client, image, 4, 2)  # warm-up: layer mounts, page cache
        res["create_p50_ms"] = await create_latency(client, image, 10 if quick else 30)
        say(f"create p50 {res['create_p50_ms']:.1f} ms")
        # Before the cycle runs: the kernel's deferred clean-up of hundreds of just-deleted
        # sandboxes (network namespaces, mounts) would otherwise be measured along.
        rtt = await exec_rtt(client, image, 200 if quick else 1000)
        res["exec_p50_ms"], res["exec_p99_ms"] = rtt["p50_ms"], rtt["p99_ms"]
        say(f"exec true p50 {rtt['p50_ms']:.2f} ms p99 {rtt['p99_ms']:.2f} ms")
        for c, n in ns.items():
            r = await cycles(client, image, n, c)
            res[f"create_exec_destroy_per_s_c{c}"] = r["per_s"]
            res[f"cycle_p50_ms_c{c}"] = r["p50_ms"]
            res[f"cycle_p99_ms_c{c}"] = r["p99_ms"]
            res[f"cycle_errors_c{c}"] = r["errors"]
            if c == 1:
                res["create_to_first_exec_p50_ms"] = r["first_exec_p50_ms"]
            say(f"rollbox c{c}: {r['per_s']:.1f}/s p50 {r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms")
        idle = await idle_density(client, image, idle_n)
        res.update(idle)
        say(f"idle: {idle['idle_sandboxes']} sandboxes, "
            f"{idle['idle_mib_per_sandbox']:.2f} MiB each")
    if shutil.which("podman"):
        tag = podman_prepare(image)
        for c in (1, 8):
            r = await podman_cycles(tag, 10 if quick else (20 if c == 1 else 48), c)
            res[f"podman_per_s_c{c}"] = r["per_s"]
            res[f"podman_p50_ms_c{c}"] = r["p50_ms"]
            say(f"podman c{c}: {r['per_s']:.1f}/s p50 {r['p50_ms']:.1f} ms")
        for c in (1, 8):
            res[f"ratio_vs_podman_c{c}"] = ratio(res[f"create_exec_destroy_per_s_c{c}"],
                                                 res[f"podman_per_s_c{c}"])
        say(f"ratio vs podman at c8: {rounded(res['ratio_vs_podman_c8'], 1)}x")
    return res


async def c8_cycles(quick: bool, url: str, key: str) -> dict[str, Any]:
    from rollbox.sdk import AsyncClient

    async with AsyncClient(base_url=url, api_key=key, timeout=120) as client:
        await cycles(client, "python:3.11", 4, 2)  # same warm-up as the hardened run
        return await cycles(client, "python:3.11", 48 if quick else 160, 8)


def hardening_overhead(quick: bool, res: dict[str, Any]) -> None:
    """Same create/exec/destroy at c8 against a server whose sandboxes are all unhardened (the
    node's unhardened_for_bench; only this benchmark sets it, only for that server)."""
    from rollbox.backends.container.sandbox import UNHARDENED_ENV

    with server_process(env={**POOL_OFF, UNHARDENED_ENV: "1"}) as (url, key):
        r = asyncio.run(c8_cycles(quick, url, key))
    res["unhardened_per_s_c8"] = r["per_s"]
    hardened_share = ratio(res["create_exec_destroy_per_s_c8"], r["per_s"])
    res["hardening_overhead"] = 1 - hardened_share if hardened_share is not None else None
    say(f"unhardened c8: {r['per_s']:.1f}/s; hardening_overhead "
        f"{rounded(res['hardening_overhead'], 3)}")


async def runtime_cycles(quick: bool, url: str, key: str) -> dict[str, Any]:
    """The c1 and c8 cycles of :func:`run` (same warm-up, same counts) on another server."""
    from rollbox.sdk import AsyncClient

    async with AsyncClient(base_url=url, api_key=key, timeout=120) as client:
        await cycles(client, "python:3.11", 4, 2)
        c1 = await cycles(client, "python:3.11", 10 if quick else 30, 1)
        c8 = await cycles(client, "python:3.11", 48 if quick else 160, 8)
    return {"c1": c1, "c8": c8}


def runtimes(quick: bool, res: dict[str, Any]) -> None:
    """The default runtime's figures under its name, the other's from a server that uses it
    (``ROLLBOX_RUNTIME``), and native against runc."""
    default = Settings().runtime
    other = "runc" if default == "native" else "native"
    res["runtime"] = default
    res[f"create_exec_destroy_per_s_c8_{default}"] = res["create_exec_destroy_per_s_c8"]
    res[f"create_to_first_exec_p50_ms_{default}"] = res["create_to_first_exec_p50_ms"]
    with server_process(env={**POOL_OFF, "ROLLBOX_RUNTIME": other}) as (url, key):
        r = asyncio.run(runtime_cycles(quick, url, key))
    res[f"create_exec_destroy_per_s_c8_{other}"] = r["c8"]["per_s"]
    res[f"cycle_errors_c8_{other}"] = r["c8"]["errors"]
    res[f"create_to_first_exec_p50_ms_{other}"] = r["c1"]["first_exec_p50_ms"]
    if "create_exec_destroy_per_s_c8_runc" in res:
        res["native_vs_runc_c8"] = ratio(res["create_exec_destroy_per_s_c8_native"],
                                         res["create_exec_destroy_per_s_c8_runc"])
    if "podman_per_s_c8" in res:
        res[f"ratio_vs_podman_c8_{other}"] = ratio(r["c8"]["per_s"], res["podman_per_s_c8"])
    say(f"{other} c8: {r['c8']['per_s']:.1f}/s, first exec p50 "
        f"{r['c1']['first_exec_p50_ms']:.1f} ms; native_vs_runc_c8 "
        f"{rounded(res.get('native_vs_runc_c8'), 2)}")


OBS_ROUNDS = (6, 10)  # rounds of each arm (quick, full), alternated off/on/on/off/...
OBS_CYCLES = 160  # c8 cycles a round (~3-4 s at ~45/s)
OBS_OFF_ENV = {"ROLLBOX_METRICS": "0", "ROLLBOX_LOG_FORMAT": "text"}
OBS_ON_ENV = {"ROLLBOX_METRICS": "1", "ROLLBOX_LOG_FORMAT": "json"}


async def obs_round(srv: ServerProcess, n: int, lat: list[float], count: bool = False
                    ) -> dict[str, float]:
    """One round of the overhead: the same warm-up, then ``n`` c8 cycles: their rate and the
    CPU per cycle (ms) of the server process (where metrics and logs are made), of the
    sandboxes' cgroups (what they ran, deleted ones included) and of this client; cycle
    times appended to ``lat``."""
    from rollbox.isolation import cgroups
    from rollbox.sdk import AsyncClient

    assert srv.proc is not None
    pid, url, key = srv.proc.pid, srv.url, srv.key
    boxes = cgroups.v2_root() / srv.settings.cgroup_parent
    async with AsyncClient(base_url=url, api_key=key, timeout=120) as client:
        await run_cycles(lambda: one_cycle(client, "python:3.11"), 16, 8, series=None)

        async def timed() -> bool:
            t = time.monotonic()
            ok = await one_cycle(client, "python:3.11")
            lat.append(time.monotonic() - t)
            return ok

        before = await scrape_counts(url, key) if count else (0.0, 0.0)
        with CpuMeter({"server": lambda: process_cpu_s(pid),
                       "sandboxes": lambda: cgroup_cpu_s(boxes),
                       "client": process_cpu_s}) as meter:
            r = await run_cycles(timed, n, 8, series=None)
        after = await scrape_counts(url, key) if count else (0.0, 0.0)
    out = {"per_s": float(r["per_s"]), "errors": r["errors"],
           **{f"{k}_ms": meter.spent[k] / n * 1000 for k in ("server", "sandboxes", "client")}}
    if count:  # the first scrape is one api request of the second's count
        out["events"] = (after[0] - before[0] - 1) / n
        out["requests"] = (after[1] - before[1] - 1) / n
    return out


async def one_cycle(client: Any, image: str) -> bool:
    sb = await client.create(image, ttl_s=300)
    r = await sb.exec(["true"])
    await sb.delete()
    return r.exit_code == 0


async def scrape_counts(url: str, key: str) -> tuple[float, float]:
    """(every event the server's /metrics counted: counters and histogram counts, of which api
    requests) at this moment."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient() as h:
        r = await h.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    r.raise_for_status()
    events = requests = 0.0
    for fam in text_string_to_metric_families(r.text):
        for x in fam.samples:
            if x.name.endswith(("_total", "_count")):
                events += x.value
                requests += x.value if x.name == "rollbox_api_request_seconds_count" else 0
    return events, requests


def recording_cost_us() -> dict[str, float]:
    """What one recorded event costs (a histogram's labels + observe; µs, best of 5) and what
    the api's timing middleware adds to a request (an ASGI call of a do-nothing app through
    it against without it), in this process."""
    import timeit

    from rollbox.api.observe import ApiMetricsMiddleware
    from rollbox.metrics import Metrics

    m = Metrics()
    obs = min(timeit.repeat(lambda: m.api_seconds.labels("POST", "/v1/sandboxes", "200")
                            .observe(0.01), number=20_000, repeat=5)) / 20_000

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def nothing(_: Any) -> None:
        pass

    async def calls(asgi: Any, n: int) -> float:
        scope = {"type": "http", "method": "GET", "path": "/"}
        t = time.perf_counter()
        for _ in range(n):
            await asgi(dict(scope), None, nothing)
        return time.perf_counter() - t

    wrapped = ApiMetricsMiddleware(app, m)
    bare = min(asyncio.run(calls(app, 20_000)) for _ in range(3)) / 20_000
    timed = min(asyncio.run(calls(wrapped, 20_000)) for _ in range(3)) / 20_000
    return {"event_us": obs * 1e6, "middleware_us": max(0.0, timed - bare) * 1e6}


@contextlib.contextmanager
def obs_servers() -> Iterator[dict[str, ServerProcess]]:
    """The two servers of the overhead, ``off`` and ``on``, each on a scratch node of its own
    (Settings.scratch: its data, cgroup parent, uid band and subnet, the node's images), both
    started once and held for the whole phase: the rounds alternate between them without a
    restart (a restart's cold caches would be measured along, and on a shared host another
    node may take a host resource between two starts)."""
    with tempfile.TemporaryDirectory(prefix="rollbox-bench-obs-") as tmp:
        os.chmod(tmp, 0o755)  # sandboxes reach their roots below it
        servers: dict[str, ServerProcess] = {}
        try:
            for arm, env in (("off", OBS_OFF_ENV), ("on", OBS_ON_ENV)):
                s = Settings.scratch(Path(tmp) / arm)
                s.node_id = f"obs{arm}{secrets.token_hex(3)}"
                servers[arm] = ServerProcess(s, env={**POOL_OFF, **env})
                servers[arm].start()
            yield servers
        finally:
            for srv in servers.values():
                srv.stop()


def observability_overhead(quick: bool, res: dict[str, Any]) -> None:
    """Metrics and logging on vs off (issue 18: <= 2 %): c8 create -> exec -> destroy rounds
    against a server (:func:`obs_servers`) with metrics off (nothing recorded, the api's timing middleware passes
    through) and text logs (``ROLLBOX_METRICS=0``, ``ROLLBOX_LOG_FORMAT=text``) and one with
    both on (the defaults), alternated off, on, on, off, ... (a drift of the host's load hits
    both arms alike), each round after the same warm-up. The overhead is
    1 - the median of the rounds' on/off ratios (each on round against the off round next to
    it); the pooled rates and the spread of the off rounds among themselves (the noise floor
    the figure has to be read against) come with it."""
    import statistics

    rounds = OBS_ROUNDS[0] if quick else OBS_ROUNDS[1]
    order = [arm for _ in range(-(-rounds // 2)) for arm in ("off", "on", "on", "off")]
    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    lat: dict[str, list[float]] = {"off": [], "on": []}
    with obs_servers() as servers:
        for arm in order[: 2 * rounds]:
            r = asyncio.run(obs_round(servers[arm], OBS_CYCLES, lat[arm], count=arm == "on"))
            rates[arm].append(r["per_s"])
            cpu[arm].append(r)
            say(f"  observability {arm}: {r['per_s']:.1f}/s, CPU per cycle: server "
                f"{r['server_ms']:.2f} ms, sandboxes {r['sandboxes_ms']:.2f}, client "
                f"{r['client_ms']:.2f}")
    for arm in ("off", "on"):
        record(f"observability_{arm}_cycle_c8", lat[arm])
    pairs = [on / off for off, on in zip(rates["off"], rates["on"], strict=True)]
    off_mean = statistics.fmean(rates["off"])
    res["observability_rounds"] = rounds
    res["observability_cycle_errors"] = sum(c["errors"] for arm in cpu.values() for c in arm)
    res["observability_off_per_s_c8"] = off_mean
    res["observability_on_per_s_c8"] = statistics.fmean(rates["on"])
    res["observability_off_rounds_per_s"] = rates["off"]
    res["observability_on_rounds_per_s"] = rates["on"]
    res["observability_on_vs_off_c8"] = statistics.median(pairs)
    res["observability_overhead"] = 1 - statistics.median(pairs)
    res["observability_overhead_pooled"] = 1 - res["observability_on_per_s_c8"] / off_mean
    res["observability_off_spread"] = (max(rates["off"]) - min(rates["off"])) / off_mean
    for arm in ("off", "on"):  # medians of the rounds' CPU per cycle
        for k in ("server", "sandboxes", "client"):
            res[f"observability_{k}_cpu_ms_{arm}"] = statistics.median(
                c[f"{k}_ms"] for c in cpu[arm])
    # What the server's extra CPU per cycle is of a cycle's CPU (server + sandboxes + client):
    # the share of a CPU-bound node's cycle rate metrics and logs take, read from CPU time,
    # which other lanes' load moves far less than the rate.
    whole = sum(res[f"observability_{k}_cpu_ms_off"] for k in ("server", "sandboxes", "client"))
    res["observability_cpu_overhead"] = (res["observability_server_cpu_ms_on"]
                                         - res["observability_server_cpu_ms_off"]) / whole
    # The profile: what metrics record per cycle (the on server's own counts) at what each
    # costs here, against the cycle's CPU; (JSON) logging adds nothing per cycle at the
    # server's WARNING level: none of these cycles logs a line.
    cost = recording_cost_us()
    events = statistics.median(c["events"] for c in cpu["on"])
    requests = statistics.median(c["requests"] for c in cpu["on"])
    res["observability_events_per_cycle"] = events
    res["observability_api_requests_per_cycle"] = requests
    res["observability_event_us"] = cost["event_us"]
    res["observability_middleware_us"] = cost["middleware_us"]
    res["observability_profiled_overhead"] = (
        events * cost["event_us"] + requests * cost["middleware_us"]) / 1000 / whole
    res["observability_cycle_p50_ms_off"] = percentile(lat["off"], 50) * 1000
    res["observability_cycle_p50_ms_on"] = percentile(lat["on"], 50) * 1000
    say(f"metrics+logs off c8: {off_mean:.1f}/s, on: {res['observability_on_per_s_c8']:.1f}/s "
        f"({rounds} rounds each); observability_overhead (median of pairs) "
        f"{rounded(res['observability_overhead'], 3)}, pooled "
        f"{rounded(res['observability_overhead_pooled'], 3)}, off rounds' spread "
        f"{rounded(res['observability_off_spread'], 3)}; server CPU per cycle off "
        f"{res['observability_server_cpu_ms_off']:.2f} ms, on "
        f"{res['observability_server_cpu_ms_on']:.2f} ms: observability_cpu_overhead "
        f"{rounded(res['observability_cpu_overhead'], 4)} of a cycle's "
        f"{whole:.2f} ms; profiled: {events:.1f} events x {cost['event_us']:.2f} us + "
        f"{requests:.1f} requests x {cost['middleware_us']:.2f} us = "
        f"{rounded(res['observability_profiled_overhead'], 4)} of it")


def main(quick: bool = False, json_out: bool = False) -> dict[str, Any]:
    with server_process(env=POOL_OFF) as (url, key):
        res = asyncio.run(run(quick, url, key))
    hardening_overhead(quick, res)
    runtimes(quick, res)
    observability_overhead(quick, res)
    pool_figures(quick, res)
    return emit(res, json_out)


def pool_figures(quick: bool, res: dict[str, Any]) -> None:
    """The warm pool's figures (``rollbox bench pool``, its own servers: every figure above is
    of servers with pools off): create p50 under the bursty arrival, the refill running, and
    a warm pool's create -> first exec p50 one at a time."""
    from rollbox.benchkit import load_bench

    r = load_bench("pool").run(quick)
    res["pool_create_p50_ms"] = r["pool_create_p50_ms"]
    res["pool_create_to_first_exec_p50_ms"] = r["pool_serial_create_to_first_exec_p50_ms"]
    res["pool_hit_ratio"] = r["pool_hit_ratio"]


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv, json_out="--json" in sys.argv)
