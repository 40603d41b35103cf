"""The ``rollbox`` command: serve, config, image, sandbox, key, demo, bench. Thin: parses arguments and
calls the component that owns the work (the operator's sandbox and key groups: operator_cli)."""
from __future__ import annotations

import functools
import inspect
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer

from rollbox.config import Settings
from rollbox.image_cli import app as image_app
from rollbox.operator_cli import key_app, project_app, sandbox_app
from rollbox.terminal import escaped_logging

app = typer.Typer(help="rollbox: elastic sandboxes for RL agents", no_args_is_help=True,
                  pretty_exceptions_enable=False)
app.add_typer(image_app, name="image", help="Build, import and inspect images")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(key_app, name="key")
bench_app = typer.Typer(help="Benchmarks (ratios against a peer measured in the same run)",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")
mirror_app = typer.Typer(help="Package mirrors (the caching PyPI proxy)", no_args_is_help=True)
app.add_typer(mirror_app, name="mirror")
app.add_typer(project_app, name="project")
cluster_app = typer.Typer(help="Cluster mode: Ray nodes, one edge per node, api replicas behind "
                          "one port (docs/cluster.md)", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")


@app.command()
def serve(host: str = typer.Option("127.0.0.1"), port: int = typer.Option(7420),
          verbose: bool = typer.Option(False, "-v")) -> None:
    """Run the embedded node: api + placement + one edge, SQLite state, local images."""
    from rollbox.embedded import EmbeddedNode

    escaped_logging(logging.INFO if verbose else logging.WARNING,
                    json_lines=Settings().log_format == "json")
    from rollbox.isolation import oom

    oom.protect()  # the platform, never a sandbox's victim (sandboxes: one memory cgroup)
    node = EmbeddedNode()
    typer.echo(f"rollbox serving on http://{host}:{port} (admin key in "
               f"{node.settings.admin_key_path})", err=True)
    import uvloop

    try:
        uvloop.run(node.serve(host, port))  # libuv loop: cheaper per request and per fd
    except KeyboardInterrupt:
        pass


@app.command("config")
def config_cmd(as_json: bool = typer.Option(False, "--json", help="print as JSON"),
               markdown: bool = typer.Option(False, "--markdown",
                                             help="print the settings reference page instead "
                                             "(docs/settings.md)")) -> None:
    """The effective settings of this node and where each came from (default or variable)."""
    from rich.console import Console

    from rollbox import config_cli
    from rollbox.config import SettingError, describe

    if markdown:
        typer.echo(config_cli.markdown(), nl=False)
        return
    try:
        entries = describe(Settings())
    except SettingError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(config_cli.as_json(entries), indent=2))
    else:
        Console().print(config_cli.table(entries))


@app.command()
def demo(n: Optional[int] = typer.Option(None, "-n", help="episodes (swe: 32 concurrent; "  # noqa: UP007
                                         "browser, desktop: 2, one at a time)"),
         url: Optional[str] = typer.Option(None, help="an already running server"),  # noqa: UP007
         task: str = typer.Option("swe", "--task", help="swe | browser (MiniWoB++ in chromium) "
                                  "| desktop (the desktop:1 VM's text editor, --backend vm)"),
         backend: str = typer.Option("container", "--backend",
                                     help="browser task: container | microvm; desktop: vm"),
         miniwob: str = typer.Option("click-button", "--miniwob",
                                     help="browser task: click-button | click-test"),
         out: Optional[Path] = typer.Option(None, "--out", help="browser and desktop tasks: "  # noqa: UP007
                                            "screenshots dir"),
         json_out: bool = typer.Option(False, "--json")) -> None:
    """The main job: N concurrent SWE-style episodes with grading in fresh sandboxes; or
    (--task browser) MiniWoB++ episodes driven by input events, graded by replay; or (--task
    desktop --backend vm) a desktop VM's editor driven by mouse and keyboard, graded by
    replaying the recorded input in a fresh VM."""
    if task == "desktop":
        if backend != "vm":
            raise typer.BadParameter("the desktop task runs on full VMs: --backend vm")
        from rollbox.desktop.episode import run_desktop_demo

        summary = run_desktop_demo(n=n or 2, url=url, out_dir=out)
    elif task == "browser":
        from rollbox.browser.episode import TASKS, run_browser_demo

        if miniwob not in TASKS:
            raise typer.BadParameter(f"--miniwob: one of {', '.join(TASKS)}")
        summary = run_browser_demo(n=n or 2, url=url, backend=backend, task=miniwob,
                                   out_dir=out)
    elif task == "swe":
        if backend != "container":
            raise typer.BadParameter("the swe demo runs on containers; --backend is for "
                                     "--task browser and desktop")
        from rollbox.demo import run_demo

        summary = run_demo(n=n or 32, url=url)
    else:
        raise typer.BadParameter("--task: swe, browser or desktop")
    if json_out:
        typer.echo(json.dumps(summary))
    if summary.get("errors"):
        raise typer.Exit(1)


def _load_bench(name: str):  # noqa: ANN202
    from rollbox.benchkit import load_bench

    try:
        return load_bench(name)
    except FileNotFoundError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None


def bench_command(name: str, group: typer.Typer = bench_app
                  ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@bench_app.command(name)`` plus the options every benchmark has: ``--plot FILE`` (the
    run's figures as a PNG, drawn by ``benchplot``) and ``--save`` (the result and the raw
    samples as ``docs/bench-results/NAME-STAMP.json``, what ``rollbox bench plot`` redraws).
    The run is recorded by ``benchkit.BenchRun`` around the command's body."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)
        extra = [
            inspect.Parameter("plot", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],  # noqa: UP007
                              default=typer.Option(None, "--plot", help="write the run's "
                                                   "figures as a PNG to this file")),
            inspect.Parameter("save", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                              default=typer.Option(False, "--save", help="save result + raw "
                                                   "samples under docs/bench-results")),
        ]

        @functools.wraps(fn)
        def run(*args: Any, plot: Optional[Path] = None, save: bool = False,  # noqa: UP007
                **kwargs: Any) -> Any:
            from rollbox import benchplot
            from rollbox.benchkit import BenchRun

            with BenchRun(name, argv=["rollbox", *sys.argv[1:]]) as rec:
                out = fn(*args, **kwargs)
            if (plot or save) and rec.result is None:
                typer.echo(f"benchmark {name} emitted no result: nothing to plot or save",
                           err=True)
                raise typer.Exit(1)
            saved = rec.save() if save else None
            if saved is not None:
                typer.echo(f"saved {saved}", err=True)
            if plot is not None:
                try:
                    benchplot.plot(benchplot.from_document(rec.document(), plot, name,
                                                           rec.started), plot)
                except benchplot.ResultError as exc:
                    typer.echo(str(exc), err=True)
                    raise typer.Exit(1) from None
                typer.echo(f"plot {plot}", err=True)
            return out

        run.__signature__ = sig.replace(  # type: ignore[attr-defined]
            parameters=[*sig.parameters.values(), *extra])
        return group.command(name)(run)

    return deco


@bench_app.command("plot")
def bench_plot(results: Optional[Path] = typer.Option(  # noqa: UP007
                   None, "--results", help="saved results (default docs/bench-results)"),
               out: Optional[Path] = typer.Option(  # noqa: UP007
                   None, "--out", help="where the PNGs go (default docs/bench-plots)")) -> None:
    """Redraw every benchmark's plot from its newest saved result (nothing is rerun)."""
    from rollbox import benchplot

    d_results, d_out = benchplot.default_dirs()
    try:
        drawn = benchplot.redraw_all(results or d_results, out or d_out)
    except benchplot.ResultError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    for name, png in drawn.items():
        typer.echo(f"{name}: {png}")
    if not drawn:
        typer.echo("no saved result had anything to draw", err=True)
        raise typer.Exit(1)


@bench_command("netpolicy")
def bench_netpolicy(quick: bool = typer.Option(False, "--quick"),
                    json_out: bool = typer.Option(False, "--json")) -> None:
    """set_network on a live sandbox: time until a new connect succeeds / an open one is cut."""
    mod = _load_bench("netpolicy")
    mod.main(quick=quick, json_out=json_out)


@bench_command("ports")
def bench_ports(quick: bool = typer.Option(False, "--quick"),
                json_out: bool = typer.Option(False, "--json")) -> None:
    """The port proxy vs a direct connection to the same service in a sandbox: p50, the
    overhead p50 (target <= 2 ms) and requests/s at c8."""
    mod = _load_bench("ports")
    mod.main(quick=quick, json_out=json_out)


@bench_command("fncall")
def bench_fncall(quick: bool = typer.Option(False, "--quick"),
                 json_out: bool = typer.Option(False, "--json")) -> None:
    """Warm-pool stateless calls (print(1), a HumanEval problem) at c1/c8/c64; a fresh
    unshare'd python3 per call as the peer."""
    mod = _load_bench("fncall")
    mod.main(quick=quick, json_out=json_out)


@bench_command("container")
def bench_container(quick: bool = typer.Option(False, "--quick"),
                    json_out: bool = typer.Option(False, "--json")) -> None:
    """create->exec->destroy at c1/c8/c32, exec round trip, idle density; podman as peer."""
    mod = _load_bench("container")
    mod.main(quick=quick, json_out=json_out)


@bench_command("density")
def bench_density(quick: bool = typer.Option(False, "--quick"),
                  n: Optional[int] = typer.Option(None, "--n", help="sandboxes (default 3200)"),  # noqa: UP007
                  json_out: bool = typer.Option(False, "--json")) -> None:
    """N idle sandboxes (default resources) held at once, every one answering an exec; host
    memory each (MemAvailable drop / N) and the limits that cap N on this node."""
    mod = _load_bench("density")
    res = mod.main(quick=quick, json_out=json_out, n=n)
    if not res.get("idle_all_answered"):
        raise typer.Exit(1)


@bench_command("qos")
def bench_qos(quick: bool = typer.Option(False, "--quick"),
              json_out: bool = typer.Option(False, "--json")) -> None:
    """A ~1 ms probe's p50/p99 inflation under batch load at 50 % / 100 % of the cores, with
    and without QoS (batch in the idle class vs the normal class), in one run."""
    mod = _load_bench("qos")
    mod.main(quick=quick, json_out=json_out)


@bench_command("pool")
def bench_pool(quick: bool = typer.Option(False, "--quick"),
               json_out: bool = typer.Option(False, "--json")) -> None:
    """Warm pools: create and create -> first exec under a bursty arrival (>= 10x the pool's
    size, its refill running) against the same arrival on a server with pools off."""
    mod = _load_bench("pool")
    mod.main(quick=quick, json_out=json_out)


@bench_command("images")
def bench_images(quick: bool = typer.Option(False, "--quick"),
                 json_out: bool = typer.Option(False, "--json")) -> None:
    """Lazy loading vs full pull: 16 sandboxes from a cold node over loopback S3 (2 ms)."""
    mod = _load_bench("images")
    res = mod.main(quick=quick, json_out=json_out)
    if res.get("errors"):
        raise typer.Exit(1)


@bench_command("files")
def bench_files(quick: bool = typer.Option(False, "--quick"),
                json_out: bool = typer.Option(False, "--json"),
                backend: str = typer.Option("container", "--backend")) -> None:
    """Server RSS while 4 x 1 GB single files stream in and out (--quick: 4 x 200 MB);
    --backend microvm: through a microVM's agent, smaller transfers."""
    mod = _load_bench("files")
    if not mod.main(quick=quick, json_out=json_out, backend=backend)["ok"]:
        raise typer.Exit(1)


@bench_command("compat")
def bench_compat(quick: bool = typer.Option(False, "--quick"),
                 json_out: bool = typer.Option(False, "--json"),
                 url: Optional[str] = typer.Option(None, help="running server (default: start one)"),  # noqa: UP007
                 n: int = typer.Option(64, "-n", help="concurrent cycles")) -> None:
    """Peer protocols vs the native SDK: 64 concurrent E2B AsyncSandbox create->run->kill."""
    mod = _load_bench("compat")
    mod.main(quick=quick, json_out=json_out, url=url, n=n)


@bench_command("disk")
def bench_disk(quick: bool = typer.Option(False, "--quick"),
               json_out: bool = typer.Option(False, "--json")) -> None:
    """Disk tier (btrfs subvolume + qgroup) vs memory tier (tmpfs) of the writable layer:
    create CPU, idle memory per sandbox, clone of a 500 MB upper."""
    mod = _load_bench("disk")
    mod.main(quick=quick, json_out=json_out)


@bench_command("fork")
def bench_fork(quick: bool = typer.Option(False, "--quick"),
               json_out: bool = typer.Option(False, "--json"),
               only: str = typer.Option("", "--only", help="comma-separated phases: "
                                        "container,microvm,ports (default: all)")) -> None:
    """Fork of a sandbox with a 500 MB writable layer (n = 1, 8, 32: all children answering
    an exec, source frozen, memory and disk per child) against snapshot + create, a full copy
    of the writable layer and 8 plain creates, in the same run."""
    mod = _load_bench("fork")
    try:
        phases = mod.parse_only(only)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--only") from None
    mod.main(quick=quick, json_out=json_out, only=phases)


@bench_command("microvm")
def bench_microvm(quick: bool = typer.Option(False, "--quick"),
                  json_out: bool = typer.Option(False, "--json"),
                  only: str = typer.Option("", "--only", help="comma-separated phases: "
                                           "restore,exec,cycles,idle,density,cold,"
                                           "no_reporting,plain,pmem (default: all)")) -> None:
    """microVMs: create -> first exec (template restore, cold boot), exec round trip, c1/c8
    cycles, idle memory and density, virtio-blk vs virtio-pmem layers; plain QEMU as peer."""
    mod = _load_bench("microvm")
    mod.main(quick=quick, json_out=json_out, only=mod.parse_only(only))


@bench_command("vm")
def bench_vm(quick: bool = typer.Option(False, "--quick"),
             json_out: bool = typer.Option(False, "--json"),
             only: str = typer.Option("", "--only", help="comma-separated phases: ready,exec,"
                                      "screenshot,input,input_to_screen,pause,idle,plain,"
                                      "restore (default: all); desktop,plain_desktop,desktop_restore opt "
                                      "in"),
             desktop: bool = typer.Option(False, "--desktop", help="also the desktop:1 disk: "
                                          "create -> drawn, and plain QEMU's boot of it "
                                          "(minutes under TCG)")) -> None:
    """Full VMs (backend vm): create -> ready, exec, screenshot, input and input-to-screen,
    pause/resume, idle memory; a plain QEMU boot of the same machine and microVM creates as
    peers; with --desktop the desktop disk's boot to a drawn desktop against plain QEMU's."""
    mod = _load_bench("vm")
    mod.main(quick=quick, json_out=json_out, only=mod.parse_only(only), desktop=desktop)


@bench_command("cluster-control")
def bench_cluster_control(quick: bool = typer.Option(False, "--quick"),
                          json_out: bool = typer.Option(False, "--json")) -> None:
    """A cluster's api -> edge control calls: HTTP (RemoteEdge) vs a Ray actor call, for
    capacity() and create, on a one-node cluster on this host."""
    mod = _load_bench("cluster_control")
    mod.main(quick=quick, json_out=json_out)


@bench_command("cluster")
def bench_cluster(quick: bool = typer.Option(False, "--quick"),
                  json_out: bool = typer.Option(False, "--json"),
                  assembled: bool = typer.Option(
                      False, "--assembled", help="edges and replicas as plain processes "
                      "(serve_edge, RemoteEdge), no Ray")) -> None:
    """create/exec/destroy at c8 and c32 through 2 api replicas over 3 edges on this host
    (PostgreSQL IAM and quota ledger, watcher) vs the embedded server, and the seconds until
    a SIGSTOPped edge's sandbox is reported node_lost (the cluster: `cluster up`'s, on Ray)."""
    mod = _load_bench("cluster")
    mod.main(quick=quick, json_out=json_out, topology="assembled" if assembled else "ray")


@bench_command("remote_edge")
def bench_remote_edge(quick: bool = typer.Option(False, "--quick"),
                      json_out: bool = typer.Option(False, "--json")) -> None:
    """The api over a local edge vs over a RemoteEdge to it served over HTTP (edge.service):
    exec(["true"]) and create/delete through the api, capacity and exec straight to the edge."""
    mod = _load_bench("remote_edge")
    mod.main(quick=quick, json_out=json_out)


@bench_command("rl")
def bench_rl(quick: bool = typer.Option(False, "--quick"),
             json_out: bool = typer.Option(False, "--json"),
             phases: str = typer.Option("grpo,many,write,restart,files",
                                        help="comma-separated subset of the phases")) -> None:
    """An RL trainer's load on one node: GRPO burst (podman as peer), 1,024 at once, 64 x 512
    MiB writes, a server restart with commands mid-stream, 1 GB single-file transfers."""
    mod = _load_bench("rl")
    opts = mod.parse_args(["--phases", phases])
    mod.main(quick=quick, json_out=json_out, phases=opts.phases)


@bench_command("placement")
def bench_placement(quick: bool = typer.Option(False, "--quick"),
                    json_out: bool = typer.Option(False, "--json")) -> None:
    """Placement decisions on 160 simulated nodes (DSec-like load, lifetimes compressed 10x):
    decisions/s on one core and load balance max/mean; random and least-loaded as peers."""
    mod = _load_bench("placement")
    mod.main(quick=quick, json_out=json_out)


@bench_command("ledger")
def bench_ledger(quick: bool = typer.Option(False, "--quick"),
                 json_out: bool = typer.Option(False, "--json")) -> None:
    """The quota ledger's reserve + commit + release per sandbox on SQLite and a real
    PostgreSQL, flat and nested projects, c1/c32, two replicas racing; reconcile of 1,000."""
    mod = _load_bench("ledger")
    mod.main(quick=quick, json_out=json_out)


@mirror_app.command("serve")
def mirror_serve(host: Optional[str] = typer.Option(None, help="default: pypi_mirror_host"),  # noqa: UP007
                 port: Optional[int] = typer.Option(None, help="default: pypi_mirror_port"),  # noqa: UP007
                 verbose: bool = typer.Option(False, "-v")) -> None:
    """Serve the caching PyPI proxy (only ever fetches from the configured upstreams)."""
    from rollbox.api.mirror import serve as serve_mirror

    escaped_logging(logging.INFO if verbose else logging.WARNING,
                    json_lines=Settings().log_format == "json")
    from rollbox.isolation import oom

    oom.protect()
    s = Settings()
    typer.echo(f"PyPI mirror on http://{host or s.pypi_mirror_host}:"
               f"{s.pypi_mirror_port if port is None else port}/simple/ "
               f"(cache {s.mirror_dir / 'pypi'})", err=True)
    import uvloop

    try:
        uvloop.run(serve_mirror(s, host, port))
    except KeyboardInterrupt:
        pass


def _cluster_call(fn, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
    from rollbox import errors

    try:
        return fn(*args, **kw)
    except errors.RollboxError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2 if isinstance(exc, errors.BadRequest) else 1) from None


@cluster_app.command("up")
def cluster_up(replicas: int = typer.Option(2, "--replicas", help="api replicas (1..5)"),
               nodes: int = typer.Option(1, "--nodes", help="edges on this host, each on a "
                                         "Ray node of its own (>1: simulated machines)"),
               burst_nodes: Optional[int] = typer.Option(  # noqa: UP007
                   None, "--burst-nodes", help="burst node slots for Ray's autoscaler (default "
                   "ROLLBOX_BURST_NODES; 0: no bursting)"),
               autoscaler_config: Optional[Path] = typer.Option(  # noqa: UP007
                   None, "--autoscaler-config", help="an operator's autoscaler YAML (a real "
                   "cloud; the burst node types are merged in); default: Ray nodes on this "
                   "host"),
               json_out: bool = typer.Option(False, "--json")) -> None:
    """Start a cluster on this host: Ray head, PostgreSQL, the edges, the api replicas (and
    with --burst-nodes the autoscaler and the burst scaler: docs/cluster.md)."""
    from rollbox.cluster import local

    state = _cluster_call(local.up, replicas=replicas, nodes=nodes, burst_nodes=burst_nodes,
                          autoscaler_config=autoscaler_config)
    if json_out:
        typer.echo(json.dumps({"api": state.api_url, "replicas": state.replica_urls,
                               "admin_key": state.admin_key, "gcs": state.gcs,
                               "nodes": [n.node_id for n in state.nodes],
                               "burst_slots": state.burst}))
        return
    typer.echo(f"rollbox cluster up: api {state.api_url} (replicas "
               f"{', '.join(state.replica_urls)}); admin key in {state.admin_key}")
    typer.echo(f"Ray head at {state.gcs}; nodes {', '.join(n.node_id for n in state.nodes)}; "
               f"join with `rollbox cluster join {state.gcs}` (and the token "
               f"{state.token_file})")
    if state.burst:
        typer.echo(f"bursting on: slots {', '.join(state.burst)} (the autoscaler starts them "
                   "above the use threshold)")


@cluster_app.command("join")
def cluster_join(address: str = typer.Argument(..., help="the Ray head, host[:port]"),
                 node: Optional[str] = typer.Option(None, "--node", help="this node's id"),  # noqa: UP007
                 token_file: Optional[Path] = typer.Option(None, "--token-file")) -> None:  # noqa: UP007
    """Join a cluster: a Ray worker node on this host and its edge."""
    from rollbox.cluster import local

    rec = _cluster_call(local.join, address, node_id=node, token_file=token_file)
    typer.echo(f"node {rec.node_id} joined; its edge at {rec.edge_url}")


@cluster_app.command("status")
def cluster_status(json_out: bool = typer.Option(False, "--json"),
                   targets: Optional[Path] = typer.Option(  # noqa: UP007
                       None, "--prometheus-targets", help="write the cluster's /metrics "
                       "targets (Prometheus file_sd JSON) to this file")) -> None:
    """Nodes, their health and their sandboxes per backend and project."""
    from rollbox.cluster import local

    st = _cluster_call(local.status)
    if targets is not None:
        tmp = targets.with_name(f".{targets.name}.tmp")
        tmp.write_text(json.dumps(st["metrics_targets"], indent=1) + "\n")
        tmp.replace(targets)  # Prometheus never reads half a file
    if json_out:
        typer.echo(json.dumps(st))
        return
    typer.echo(f"api {st['api']} (replicas {', '.join(st['replicas'])}); Ray head {st['gcs']}; "
               f"admin key in {st['admin_key']}")
    if st.get("burst_slots"):
        up = [n["node_id"] for n in st["nodes"] if n.get("burst")]
        typer.echo(f"burst slots {', '.join(st['burst_slots'])}; up {', '.join(up) or '-'}")
    typer.echo(f"{st['sandboxes']} sandboxes; by backend {json.dumps(st['by_backend'])}; "
               f"by project {json.dumps(st['by_project'])}")
    for n in st["nodes"]:
        seen = "never" if n["last_seen_s"] is None else f"{n['last_seen_s']:.1f}s ago"
        kind = " (burst, draining)" if n.get("draining") else " (burst)" if n.get("burst") \
            else ""
        typer.echo(f"node {n['node_id']}{kind}: {n['health']} (seen {seen}), {n['sandboxes']} "
                   f"sandboxes, {n['lost']} lost; backends {','.join(n['backends']) or '-'}; "
                   f"by backend {json.dumps(n['by_backend'])}; by project "
                   f"{json.dumps(n['by_project'])}")


@cluster_app.command("down")
def cluster_down(keep: bool = typer.Option(False, "--keep-sandboxes",
                                           help="leave sandboxes running (the next edges of "
                                           "these nodes re-adopt them)")) -> None:
    """Stop the cluster run from this host: replicas, edges, every Ray process."""
    from rollbox.cluster import local

    _cluster_call(local.down, destroy=not keep)
    typer.echo("rollbox cluster down")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
