"""`rollbox sandbox|key|project ...`: the operator's commands, through the HTTP API.

Everything goes through the SDK against a running server: ``--url`` / ``ROLLBOX_URL`` (default
the local node), ``--api-key`` / ``ROLLBOX_API_KEY``, else the node's admin key file
(``Settings.admin_key_path``). Only ``key create`` works on the key store directly (there must
be a way to make the first key). Text a sandbox wrote (command output, event data, labels) is
printed through :func:`rollbox.terminal.escape_control`, so a sandbox can not drive the operator's terminal.
Mounted by the main CLI; owns nothing but these commands.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Literal, Optional, cast

import typer
from rich.console import Console
from rich.markup import escape as markup_escape
from rich.table import Table

from rollbox import errors
from rollbox.config import Settings
from rollbox.terminal import escape_control

console = Console(stderr=True)
out = Console(highlight=False)

sandbox_app = typer.Typer(help="Sandboxes on a running server (by id, label, project or job)",
                          no_args_is_help=True)
key_app = typer.Typer(help="API keys", no_args_is_help=True)
project_app = typer.Typer(help="Projects: nested, with quotas carved out of the parent's",
                          no_args_is_help=True)

def _text(data: bytes | str) -> str:
    if isinstance(data, bytes):
        data = data.decode("utf-8", "backslashreplace")
    return escape_control(data)


# ---- connection -------------------------------------------------------------------------
_conn: dict[str, str | None] = {"url": None, "api_key": None}


def _connection(url: Optional[str] = typer.Option(  # noqa: UP007 (typer needs Optional)
        None, "--url", help="server (default: $ROLLBOX_URL, else http://127.0.0.1:7420)"),
        api_key: Optional[str] = typer.Option(  # noqa: UP007
            None, "--api-key",
            help="default: $ROLLBOX_API_KEY, else the node's admin key file")) -> None:
    _conn["url"], _conn["api_key"] = url, api_key


sandbox_app.callback()(_connection)
key_app.callback()(_connection)
project_app.callback()(_connection)


def _api_key() -> str:
    from rollbox.sdk import default_api_key

    if key := _conn["api_key"] or default_api_key():
        return key
    path = Settings().admin_key_path
    try:
        return path.read_text().strip()
    except OSError as exc:
        console.print(f"[red]error[/red]: no API key: set ROLLBOX_API_KEY or --api-key "
                      f"(reading {markup_escape(str(path))}: {markup_escape(exc.strerror or '')})")
        raise typer.Exit(2) from None


@contextmanager
def _client() -> Iterator[Any]:
    """A sync SDK client; typed errors end the command with their message (exit 2 for the
    caller's mistakes, 1 for the platform's)."""
    import rollbox

    key = _api_key()
    try:
        with rollbox.Client(_conn["url"], key) as client:
            yield client
    except errors.RollboxError as exc:
        console.print(f"[red]error[/red] ({exc.code}): {markup_escape(_text(exc.message))}",
                      soft_wrap=True)
        raise typer.Exit(2 if exc.status < 500 else 1) from None


def _labels(items: list[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise typer.BadParameter(f"label filter must be k=v, got {item!r}")
        labels[k] = v
    return labels


def _when(ts: float | None) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _age(ts: float) -> str:
    s = max(0.0, time.time() - ts)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


def _cell(value: str) -> str:
    """A table cell: controls escaped, and newlines and tabs too (a label value with a
    newline would otherwise forge a row that a script reading the piped table acts on)."""
    return _text(value).replace("\n", "\\n").replace("\t", "\\t")


def _table(headers: list[str], rows: list[list[str]]) -> None:
    """A table on a terminal; tab-separated lines, nothing shortened, when piped."""
    if not out.is_terminal:
        for row in [headers, *rows]:
            typer.echo("\t".join(_cell(c) for c in row))
        return
    table = Table(*headers)
    # ids are what the other commands take: never shortened, whatever the terminal's width
    table.columns[0].no_wrap = True
    table.columns[0].min_width = max((len(r[0]) for r in rows), default=2)
    for row in rows:
        table.add_row(*(markup_escape(_cell(c)) for c in row))
    out.print(table)


# ---- selection ------------------------------------------------------------------------------
IdsArg = typer.Argument(None, help="sandbox ids")
LabelOpt = typer.Option([], "-l", "--label", help="k=v, repeatable; all must match")
ProjectOpt = typer.Option(None, "--project", help="one project's (admin key)")
JobOpt = typer.Option(None, "--job", help="one job's")


def _select(client: Any, ids: list[str] | None, labels: list[str], project: str | None,
            job: str | None, state: list[str] | None = None) -> list[Any]:
    """Sandboxes by id (each must exist), or the live ones matching every selector given."""
    want = _labels(labels)
    if ids:
        found = [client.get(i) for i in ids]
        return [sb for sb in found
                if all(sb.info.labels.get(k) == v for k, v in want.items())
                and (project is None or sb.info.owner == project)
                and (job is None or sb.info.job == job)]
    return list(client.list(want or None, state or None, job=job, project=project))


# ---- sandbox commands ----------------------------------------------------------------------
@sandbox_app.command("ls")
def sandbox_ls(ids: Optional[list[str]] = IdsArg, label: list[str] = LabelOpt,  # noqa: UP007
               project: Optional[str] = ProjectOpt, job: Optional[str] = JobOpt,  # noqa: UP007
               state: list[str] = typer.Option([], "--state", help="running, paused..."),
               json_out: bool = typer.Option(False, "--json")) -> None:
    """List live sandboxes (an admin key sees every project's)."""
    with _client() as client:
        found = _select(client, ids, label, project, job, state)
    if json_out:
        typer.echo(json.dumps([sb.info.model_dump(mode="json") for sb in found]))
        return
    rows = []
    for sb in found:
        i = sb.info
        labels = ",".join(f"{k}={v}" for k, v in sorted(i.labels.items()))
        rows.append([i.id, i.owner, i.job or "-", i.state, i.image, _age(i.created_at),
                     f"{max(0.0, i.expires_at - time.time()):.0f}s", labels])
    _table(["ID", "PROJECT", "JOB", "STATE", "IMAGE", "AGE", "EXPIRES IN", "LABELS"], rows)


@sandbox_app.command("inspect")
def sandbox_inspect(ids: list[str] = typer.Argument(..., help="sandbox ids")) -> None:
    """Everything known of each sandbox (also dead or deleted ones) and its commands, as JSON."""
    docs = []
    with _client() as client:
        for sid in ids:
            sb = client.get(sid)
            doc = sb.info.model_dump(mode="json")
            try:
                doc["processes"] = [p.model_dump(mode="json") for p in sb.processes()]
            except (errors.SandboxDead, errors.NotFound):
                doc["processes"] = []
            docs.append(doc)
    # ensure_ascii: every control character a sandbox put in (labels, commands) stays escaped
    typer.echo(json.dumps(docs if len(docs) > 1 else docs[0], indent=2, ensure_ascii=True))


@sandbox_app.command("fork")
def sandbox_fork(sandbox_id: str = typer.Argument(...),
                 n: int = typer.Argument(1, help="children to make (all or none)"),
                 label: list[str] = typer.Option([], "-l", "--label",
                                                 help="k=v added to the inherited labels"),
                 as_json: bool = typer.Option(False, "--json", help="the full answer")) -> None:
    """Fork a sandbox into N new ones with its filesystem state (docs/sdk.md, Fork): one id
    per line (or the answer as JSON)."""
    with _client() as client:
        source = client.get(sandbox_id)
        children = source.fork(n, labels=_labels(label))
        result = source.last_fork
    if as_json and result is not None:
        typer.echo(json.dumps(result.model_dump(mode="json"), indent=2, ensure_ascii=True))
        return
    for child in children:
        typer.echo(child.id)


@sandbox_app.command("exec")
def sandbox_exec(sandbox_id: str = typer.Argument(...),
                 argv: list[str] = typer.Argument(None, help="command and arguments (after --)"),
                 shell: Optional[str] = typer.Option(None, "-c", help="a shell command string"),  # noqa: UP007
                 cwd: str = typer.Option("/", "--cwd"), user: str = typer.Option("root", "--user"),
                 timeout: Optional[float] = typer.Option(None, "--timeout"),  # noqa: UP007
                 raw: bool = typer.Option(False, "--raw",
                                          help="output bytes unescaped even on a terminal"),
                 pty: bool = typer.Option(False, "--pty", "-t",
                                          help="on a terminal (interactive when stdin and "
                                          "stdout are terminals)"),
                 cols: Optional[int] = typer.Option(None, "--cols",  # noqa: UP007
                                                    help="terminal width (default: yours, or 80)"),
                 rows: Optional[int] = typer.Option(None, "--rows",  # noqa: UP007
                                                    help="terminal height (default: yours, or 24)"),
                 ) -> None:
    """Run a command, stream its output, exit with its exit code (128+N for signal N, 124 on
    timeout). On a terminal, control bytes of the output are shown escaped unless --raw.
    --pty: the command runs on a terminal; with stdin and stdout terminals it is interactive
    (yours in raw mode, its size followed; sequences that act beyond the screen, such as
    clipboard access, are dropped unless --raw); else piped stdin is typed into it, then ^D."""
    if (shell is None) == (not argv):
        raise typer.BadParameter("give a command after -- or one string with -c")
    cmd: str | list[str] = shell if shell is not None else list(argv)
    if pty:
        _exec_pty(sandbox_id, cmd, cwd, user, timeout, raw, cols, rows)
        return

    def sink(stream: Any) -> Callable[[str], None]:
        safe = not raw and stream.isatty()

        def write(text: str) -> None:
            stream.write(escape_control(text) if safe else text)
            stream.flush()

        return write

    with _client() as client:
        res = client.get(sandbox_id).exec(cmd, cwd=cwd, user=user, timeout=timeout,
                                          on_stdout=sink(sys.stdout), on_stderr=sink(sys.stderr))
    _exit_with(res)


def _exit_with(res: Any) -> None:
    if res.timed_out:
        raise typer.Exit(124)
    if res.signal is not None:
        raise typer.Exit(128 + res.signal)
    raise typer.Exit(res.exit_code if res.exit_code is not None else 1)


def _exec_pty(sandbox_id: str, cmd: str | list[str], cwd: str, user: str,
              timeout: float | None, raw: bool, cols: int | None, rows: int | None) -> None:
    """``sandbox exec --pty``: interactive on a local terminal, else run to completion."""
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    size = os.get_terminal_size(sys.stdout.fileno()) if interactive else None
    cols = cols or (size.columns if size else 80)
    rows = rows or (size.lines if size else 24)
    if not interactive:
        typed = sys.stdin.buffer.read(16 << 20) if not sys.stdin.isatty() else None
        safe = not raw and sys.stdout.isatty()
        with _client() as client:
            res = client.get(sandbox_id).exec(
                cmd, cwd=cwd, user=user, timeout=timeout, stdin=typed, pty=True, cols=cols,
                rows=rows, on_stdout=lambda t: (sys.stdout.write(escape_control(t) if safe
                                                                 else t), sys.stdout.flush()))
        _exit_with(res)
    with _client() as client:
        proc = client.get(sandbox_id).exec_background(cmd, cwd=cwd, user=user, timeout=timeout,
                                                      pty=True, cols=cols, rows=rows)
        _attach_terminal(proc, raw)
        res = proc.wait()
    _exit_with(res)


def _attach_terminal(proc: Any, raw: bool) -> None:
    """The local terminal attached to a pty command until it exits: raw mode (restored at the
    end, whatever happens), keys forwarded as typed, SIGWINCH forwarded as a resize, output
    through :class:`rollbox.terminal.TerminalFilter` (unless ``raw``)."""
    import signal
    import termios
    import threading
    import tty

    from rollbox.terminal import TerminalFilter

    fd_in, fd_out = sys.stdin.fileno(), sys.stdout.fileno()
    saved = termios.tcgetattr(fd_in)
    done = threading.Event()

    def keys() -> None:
        import select

        while not done.is_set():
            ready, _, _ = select.select([fd_in], [], [], 0.2)
            if not ready:
                continue
            data = os.read(fd_in, 4096)
            if not data:
                return
            try:
                proc.write_stdin(data)
            except errors.RollboxError:
                return  # it exited

    def winch(_sig: int, _frame: Any) -> None:
        size = os.get_terminal_size(fd_out)
        threading.Thread(target=_resize_quietly, args=(proc, size.columns, size.lines),
                         daemon=True).start()

    old_winch = signal.signal(signal.SIGWINCH, winch)
    tty.setraw(fd_in)
    reader = threading.Thread(target=keys, name="rollbox-pty-keys", daemon=True)
    reader.start()
    shown = TerminalFilter()
    try:
        for chunk in proc.attach():
            os.write(fd_out, chunk.data if raw else shown.feed(chunk.data))
    finally:
        done.set()
        termios.tcsetattr(fd_in, termios.TCSADRAIN, saved)
        signal.signal(signal.SIGWINCH, old_winch)
        reader.join(1)


def _resize_quietly(proc: Any, cols: int, rows: int) -> None:
    try:
        proc.resize(max(1, min(cols, 1000)), max(1, min(rows, 1000)))
    except errors.RollboxError:
        pass  # exited meanwhile


@sandbox_app.command("logs")
def sandbox_logs(sandbox_id: str = typer.Argument(...),
                 exec_id: Optional[str] = typer.Option(None, "--exec", help="one command's"),  # noqa: UP007
                 follow: bool = typer.Option(False, "-f", "--follow",
                                             help="until the sandbox is deleted"),
                 json_out: bool = typer.Option(False, "--json")) -> None:
    """The sandbox's event log (lifecycle, commands and their output); also after deletion.
    Control bytes a command printed are shown escaped."""
    with _client() as client:
        for ev in client.get(sandbox_id).stream_events(0, follow):
            if exec_id is not None and ev.exec_id != exec_id:
                continue
            if json_out:
                typer.echo(json.dumps(ev.model_dump(mode="json"), ensure_ascii=True))
                continue
            head = f"{_when(ev.ts)} {ev.kind}" + (f" {ev.exec_id}" if ev.exec_id else "")
            data = _text(ev.data)
            if ev.kind in ("exec.stdout", "exec.stderr"):
                lines = data.split("\n")
                if lines[-1] == "":
                    lines.pop()
                for line in lines:
                    typer.echo(f"{head} | {line}")
            else:
                typer.echo(f"{head} {data}".rstrip())


@sandbox_app.command("rm")
def sandbox_rm(ids: Optional[list[str]] = IdsArg, label: list[str] = LabelOpt,  # noqa: UP007
               project: Optional[str] = ProjectOpt, job: Optional[str] = JobOpt,  # noqa: UP007
               yes: bool = typer.Option(False, "-y", "--yes", help="no confirmation")) -> None:
    """Delete sandboxes by id or selector. More than one asks first unless --yes (and is refused
    without a terminal to ask on)."""
    if not ids and not label and project is None and job is None:
        raise typer.BadParameter("name sandbox ids or a selector (-l, --project, --job)")
    with _client() as client:
        doomed = _select(client, ids, label, project, job)
        if not doomed:
            console.print("nothing matches")
            return
        if len(doomed) > 1 and not yes:
            if not sys.stdin.isatty():
                console.print(f"[red]error[/red]: refusing to delete {len(doomed)} sandboxes "
                              "without --yes (no terminal to ask on)")
                raise typer.Exit(2)
            for sb in doomed:
                console.print(f"  {markup_escape(_text(sb.id))} ({markup_escape(_text(sb.info.owner))})")
            if not typer.confirm(f"delete these {len(doomed)} sandboxes?", err=True):
                raise typer.Exit(1)
        failed = 0
        for sb in doomed:
            try:
                sb.delete()
                typer.echo(sb.id)
            except errors.RollboxError as exc:
                failed += 1
                console.print(f"[red]error[/red] {sb.id} ({exc.code}): "
                              f"{markup_escape(_text(exc.message))}")
    if failed:
        raise typer.Exit(1)


# ---- key commands ----------------------------------------------------------------------------
@key_app.command("create")
def key_create(project: str = typer.Option(..., help="project the key acts for"),
               admin: bool = typer.Option(False, help="it administers the project's subtree "
                                          "(--local: everything, the operator's)"),
               local: bool = typer.Option(False, help="write the node's key store directly "
                                          "(no server; the host's root only)"),
               fmt: str = typer.Option("rollbox", "--format",
                                       help="rollbox (rbx_...) or e2b (e2b_<hex>, E2B's own form "
                                       "for the E2B SDK)")) -> None:
    """Create a key of a project this key administers, through the server (Forbidden for any
    other); printed once, never again. ``--local``: in this node's key store."""
    if fmt not in ("rollbox", "e2b"):
        console.print(f"[red]error[/red] (bad_request): --format must be rollbox or e2b, not "
                      f"{markup_escape(fmt[:40])!r}")
        raise typer.Exit(2)
    key_fmt = cast(Literal["rollbox", "e2b"], fmt)
    if not local:
        with _client() as client:
            typer.echo(client.create_key(project, admin=admin, format=key_fmt).key)
        return
    from rollbox.iam.keys import KeyStore

    keys = KeyStore(Settings().data_dir / "keys.db")
    try:
        typer.echo(keys.create(project, admin=admin, fmt=key_fmt))
    except errors.RollboxError as exc:
        console.print(f"[red]error[/red] ({exc.code}): {markup_escape(exc.message)}")
        raise typer.Exit(2) from None
    finally:
        keys.close()


@key_app.command("ls")
def key_ls(project: Optional[str] = typer.Option(None, "--project"),  # noqa: UP007
           json_out: bool = typer.Option(False, "--json")) -> None:
    """List API keys (never their secrets), through the server (admin key)."""
    with _client() as client:
        keys = client.keys(project)
    if json_out:
        typer.echo(json.dumps([k.model_dump(mode="json") for k in keys]))
        return
    _table(["ID", "PROJECT", "ADMIN", "KEY", "CREATED", "LAST USED", "REVOKED"],
           [[k.key_id, k.project, "yes" if k.admin else "", k.display, _when(k.created_at),
             _when(k.last_used_at), _when(k.revoked_at) if k.revoked_at else ""] for k in keys])


@key_app.command("revoke")
def key_revoke(key_ids: list[str] = typer.Argument(..., help="key ids (key_...)")) -> None:
    """Revoke keys: the running server refuses them from the next request on."""
    with _client() as client:
        for key_id in key_ids:
            client.revoke_key(key_id)
            typer.echo(f"revoked {key_id}")


@project_app.command("create")
def project_create(
    name: str = typer.Argument(..., help="full path (team/run-7), or one segment with --parent"),
    parent: Optional[str] = typer.Option(None, help="parent project"),  # noqa: UP007
    sandboxes: Optional[int] = typer.Option(None, help="live sandboxes"),  # noqa: UP007
    cpus: Optional[float] = typer.Option(None, help="sum of requested CPUs"),  # noqa: UP007
    memory_mib: Optional[int] = typer.Option(None, help="sum of requested memory"),  # noqa: UP007
    layer_mib: Optional[int] = typer.Option(None, help="storage of its own layers"),  # noqa: UP007
) -> None:
    """Create a sub-project of one this key administers, with limits carved out of the
    parent's (none given: it holds nothing of what the parent limits). Prints it as JSON."""
    with _client() as client:
        p = client.create_project(name, parent=parent, sandboxes=sandboxes, cpus=cpus,
                                  memory_mib=memory_mib, layer_mib=layer_mib)
    typer.echo(p.model_dump_json())


@project_app.command("ls")
def project_ls(json_out: bool = typer.Option(False, "--json")) -> None:
    """This key's subtree: limits, use (with sub-projects), delegated to children."""
    with _client() as client:
        projects = client.projects()
    if json_out:
        typer.echo(json.dumps([p.model_dump(mode="json") for p in projects]))
        return

    def lim(v: object) -> str:
        return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)

    _table(["PROJECT", "SANDBOXES", "CPUS", "MEMORY MIB", "DELEGATED (SB/CPU/MIB)"],
           [[p.name, f"{p.used.sandboxes}/{lim(p.quota.sandboxes)}",
             f"{p.used.cpus:g}/{lim(p.quota.cpus)}",
             f"{p.used.memory_mib}/{lim(p.quota.memory_mib)}",
             f"{p.delegated.sandboxes}/{p.delegated.cpus:g}/{p.delegated.memory_mib}"]
            for p in projects])


@project_app.command("quota")
def project_quota(
    project: str = typer.Argument(..., help="project name"),
    sandboxes: Optional[int] = typer.Option(None, help="live sandboxes"),  # noqa: UP007
    cpus: Optional[float] = typer.Option(None, help="sum of requested CPUs"),  # noqa: UP007
    memory_mib: Optional[int] = typer.Option(None, help="sum of requested memory"),  # noqa: UP007
    layer_mib: Optional[int] = typer.Option(None, help="storage of its own layers"),  # noqa: UP007
    clear: bool = typer.Option(False, help="make every limit not given unlimited"),
) -> None:
    """Show a project's quota as JSON; with limits, set them (the others stay unless
    --clear; an admin key of a project above it). A negative limit, one above a node's
    capacity or above what the parent has left to delegate is refused."""
    given = {"sandboxes": sandboxes, "cpus": cpus, "memory_mib": memory_mib,
             "layer_mib": layer_mib}
    with _client() as client:
        quota = client.project_quota(project)
        if clear or any(v is not None for v in given.values()):
            base = {} if clear else quota.model_dump()
            quota = client.set_project_quota(project, **{
                **base, **{k: v for k, v in given.items() if v is not None}})
    typer.echo(json.dumps({"project": project, **quota.model_dump()}))
