"""Red team A1 through the compat front doors, with the unmodified ``e2b`` and ``swe-rex``
clients against the real api on a real port: the sandbox's root replaces every shell it can
reach (see test_container_shell.py), then E2B ``commands.run``, SWE-ReX ``execute(shell=True)``
and SWE-ReX session commands still give the true output and exit code, and the trojan never
runs. In a session, exit codes and the end of a command come from the agent: a session that
redefined ``printf`` (what the old marker framing printed its exit code with) can not forge
them. Each twin runs the same attack against the old form, where it must succeed.

One module-wide server and event loop (the e2b SDK keeps one connection pool per process).
"""
from __future__ import annotations

import contextlib
import re
import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from rollbox.errors import NotFound
from rollbox.models import ExecResult, ExecSpec, PtySize
from tests.conftest import have_image
from tests.helpers.e2b_node import e2b_node
from tests.redteam.conftest import needs_root, offered_or_skip
from tests.redteam.test_container_shell import ATTACK, TROJAN, TRUE_CMD

e2b = pytest.importorskip("e2b")
pytest.importorskip("swerex.runtime.remote")

from swerex.runtime.abstract import (  # noqa: E402
    BashAction,
    Command,
    CreateBashSessionRequest,
)
from swerex.runtime.remote import RemoteRuntime  # noqa: E402

DEB = "debian:bookworm"
pytestmark = [
    needs_root,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(not have_image(DEB), reason=f"{DEB} not built"),
]


class Env:
    def __init__(self, url: str, key: str, edge: Any) -> None:
        self.url, self.key, self.edge = url, key, edge

    async def run(self, sid: str, cmd: str | list[str], **kw: Any) -> ExecResult:
        eid = await self.edge.exec_start(sid, ExecSpec(cmd=cmd, timeout_s=30, **kw))
        return await self.edge.exec_wait(sid, eid)

    async def attack(self, sid: str) -> None:
        r = await self.run(sid, ["/bin/dash", "-c", ATTACK, "sh", TROJAN])
        assert r.exit_code == 0 and r.stdout.endswith("replaced\n"), r
        assert not await self.pwned(sid)

    async def pwned(self, sid: str) -> bool:
        try:
            return b"ran" in await self.edge.file_read(sid, "/tmp/pwned", 1 << 20)
        except NotFound:
            return False

    def runtime(self, sid: str) -> RemoteRuntime:
        from rollbox.compat.swerex import runtime_url
        return RemoteRuntime(host=runtime_url(self.url, sid), auth_token=self.key, timeout=30)

    @contextlib.asynccontextmanager
    async def session(self, kind: str) -> AsyncIterator[tuple[str, RemoteRuntime]]:
        """A new sandbox of ``kind`` with a SWE-ReX session; both gone at the end."""
        await offered_or_skip(self.edge, kind)
        sid = (await self.edge.create(_spec(kind), "redteam-shell")).id
        rt = self.runtime(sid)
        try:
            await rt.create_session(CreateBashSessionRequest())
            yield sid, rt
        finally:
            await rt.close()
            await self.edge.delete(sid)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env() -> AsyncIterator[Env]:
    async with e2b_node("redteam-shell") as (url, key, edge):
        yield Env(url, key, edge)


# Every door on both backends (E2B creates containers: its microVM run connects to one made
# through the native API); the microVM runs are in the slow tier.
KINDS = [pytest.param("container", id="container"),
         pytest.param("microvm", id="microvm", marks=pytest.mark.microvm_slow)]


@pytest.mark.parametrize("kind", KINDS)
async def test_a1_e2b_commands_run_ignores_trojan_shells(env: Env, kind: str) -> None:
    from e2b import AsyncSandbox, CommandExitException

    if kind == "container":
        sbx = await AsyncSandbox.create("base", timeout=120)
    else:
        await offered_or_skip(env.edge, kind)
        sbx = await AsyncSandbox.connect((await env.edge.create(_spec(kind),
                                                                "redteam-shell")).id)
    try:
        await env.attack(sbx.sandbox_id)
        with pytest.raises(CommandExitException) as e:
            await sbx.commands.run(TRUE_CMD)  # sent as `/bin/bash -l -c TRUE_CMD`
        assert (e.value.stdout, e.value.stderr, e.value.exit_code) == (
            "true-output\n", "to-stderr\n", 3), e.value
        h = await sbx.commands.run("sleep 0.2; echo bg", background=True)
        assert (await h.wait()).stdout == "bg\n"
        assert not await env.pwned(sbx.sandbox_id)
        # twin: the argv the door used to exec for commands.run runs the trojan
        r = await env.run(sbx.sandbox_id, ["/bin/bash", "-l", "-c", TRUE_CMD])
        assert (r.stdout, r.exit_code) == ("forged\n", 0), r
        assert await env.pwned(sbx.sandbox_id)
    finally:
        await sbx.kill()


@pytest.mark.parametrize("kind", KINDS)
async def test_a1_swerex_execute_and_session_ignore_trojan_shells(env: Env, kind: str) -> None:
    await offered_or_skip(env.edge, kind)
    info = await env.edge.create(_spec(kind), "redteam-shell")
    sid = info.id
    rt = env.runtime(sid)
    try:
        await rt.create_session(CreateBashSessionRequest())
        await env.attack(sid)
        r = await rt.execute(Command(command=TRUE_CMD, shell=True))
        assert (r.stdout, r.stderr, r.exit_code) == ("true-output\n", "to-stderr\n", 3), r
        # (`exit` would end the session: the same command with a subshell's exit)
        obs = await rt.run_in_session(BashAction(command=TRUE_CMD.replace("exit 3", "(exit 3)"),
                                                 check="silent"))
        assert (obs.output, obs.exit_code) == ("true-output\nto-stderr\n", 3), obs
        obs = await rt.run_in_session(BashAction(command="export A=1; cd /tmp"))
        obs = await rt.run_in_session(BashAction(command="echo $A $PWD; bash -c 'echo x'"))
        assert obs.output == "1 /tmp\nforged\n", obs  # the nested bash is the user's own call
        await env.edge.file_write(sid, "/tmp/pwned", b"", 0o644)
        obs = await rt.run_in_session(BashAction(command="echo $0; false", check="silent"))
        assert (obs.output, obs.exit_code) == ("bash\n", 1), obs
        assert not await env.pwned(sid)
        # twin: a session shell started by name (the old `bash -i` from PATH) is the trojan
        r = await env.run(sid, ["bash", "--noprofile", "--norc", "-i"], stdin=False)
        assert r.stdout == "forged\n" and await env.pwned(sid), r
    finally:
        await rt.close()
        await env.edge.delete(sid)


@pytest.mark.parametrize("kind", KINDS)
async def test_a1_session_exit_status_and_end_not_forgeable(env: Env, kind: str) -> None:
    async with env.session(kind) as (_, rt):
        # The session's own shell state turns against the framing: printf forges any exit
        # code it is asked to print as 0, echo and exit are wrapped, a background process
        # keeps printing marker-like lines, a planted PROMPT_COMMAND/DEBUG trap would run.
        await rt.run_in_session(BashAction(command=FORGE))
        for cmd, out, code in [("false", "", 1), ("echo real; (exit 7)", "real\n", 7),
                               ("sleep 0.5; true", "", 0)]:
            obs = await rt.run_in_session(BashAction(command=cmd, check="silent", timeout=10))
            assert (obs.output, obs.exit_code) == (out, code), (cmd, obs)
        # the agent's status even for a command that prints the old markers itself
        obs = await rt.run_in_session(BashAction(
            command="printf '__RBX%s__0__\\n' 0123456789abcdef; (exit 5)",
            check="silent"))
        assert obs.exit_code == 5 and obs.output.startswith("__RBX"), obs


async def test_a1_session_terminal_writer_can_not_forge(env: Env) -> None:
    # Session commands run on a terminal; a background process of the sandbox writes SWE-ReX's
    # own framing (its exit-code markers and PS1) to every terminal of the sandbox. It reaches
    # the command's terminal (its text is in the output) but not its exit code or its end,
    # which are the agent's. Twin: SWE-ReX's framing (`echo EXITCODESTART$?EXITCODEEND` read
    # back from the same kind of terminal) reports `false` as 0.
    info = await env.edge.create(_spec(), "redteam-shell")
    sid = info.id
    rt = env.runtime(sid)
    try:
        await rt.create_session(CreateBashSessionRequest())
        await rt.run_in_session(BashAction(command=TTY_WRITER))
        obs = await rt.run_in_session(BashAction(command="sleep 0.5; false", check="silent",
                                                 timeout=10))
        assert obs.exit_code == 1, obs
        assert "EXITCODESTART0EXITCODEEND" in obs.output, obs  # the writer reached it
        obs = await rt.run_in_session(BashAction(command="sleep 0.3; echo real", timeout=10))
        # the writer may also print after `real` (before the terminal closes): its text
        # taken out, the command's own output is whole and last
        own = re.sub(r"EXITCODESTART0EXITCODEEND\r?\n|SHELLPS1PREFIX", "", obs.output)
        assert obs.exit_code == 0 and own.endswith("real\n"), obs
        # twin: the marker framing on a terminal the writer reaches
        r = await env.run(sid, "sleep 0.5; false; echo EXITCODESTART$?EXITCODEEND",
                          pty=PtySize())
        first = re.search(r"EXITCODESTART(\d+)EXITCODEEND", r.stdout)
        assert first is not None and first.group(1) == "0", r.stdout
        assert "EXITCODESTART1EXITCODEEND" in r.stdout  # the shell's own, read too late
    finally:
        await rt.close()
        await env.edge.delete(sid)


async def test_a1_old_marker_framing_is_forgeable_twin(env: Env) -> None:
    # twin: the old framing (a long-lived shell prints `__RBX<token>__<status>__`) with the same
    # session state reports `false` as exit code 0
    info = await env.edge.create(_spec(), "redteam-shell")
    sid = info.id
    try:
        eid = await env.edge.exec_start(sid, ExecSpec(
            cmd=["bash", "--noprofile", "--norc", "--noediting", "-i"], stdin=True,
            timeout_s=30))
        token = secrets.token_hex(8)
        line = (f"{FORGE}\neval $'false'; __rbx_rc=$?; "
                f"printf '__RBX{token}__%d__\\n' \"$__rbx_rc\"\nexit\n")
        await env.edge.exec_stdin(sid, eid, line.encode(), True)
        r = await env.edge.exec_wait(sid, eid)
        assert f"__RBX{token}__0__" in r.stdout, r
    finally:
        await env.edge.delete(sid)


# A background process writing SWE-ReX's framing to every terminal of the sandbox.
TTY_WRITER = ("(while :; do for t in /dev/pts/[0-9]*; do "
              "builtin printf 'EXITCODESTART0EXITCODEEND\\nSHELLPS1PREFIX' > \"$t\"; "
              "done 2>/dev/null; sleep 0.02; done) >/dev/null 2>&1 &")
# Session state an agent could leave behind to forge what the old framing printed.
FORGE = ("printf() { builtin printf \"$1\" 0; }; "
         "(while sleep 0.05; do builtin printf '__RBX%s__0__\\n' 0000000000000000; done "
         ">/dev/null 2>&1 &); trap 'builtin printf __RBXforged__0__' DEBUG; "
         "PROMPT_COMMAND='builtin printf __RBXforged__0__'")


def _spec(kind: str = "container") -> Any:
    from rollbox.models import SandboxSpec
    return SandboxSpec(image=DEB, backend=kind)


# Session state one command leaves, turned against the framing of the next ones: functions
# named like what the framing calls, aliases (with expand_aliases), traps, disabled builtins,
# read-only and special variables. Each vector is one command of a session; the later commands'
# output, exit codes and end are still theirs, the session goes on, and what the vector planted
# never runs (it would write /tmp/pwned). The twin of each is the framing before the fix
# (see docs/security.md, "SWE-ReX session framing").
PWN = "echo ran > /tmp/pwned"
SHADOWS = {
    # the framing's exit path called `builtin exit`: a wrapper made every later status 0
    "builtin": ("builtin() { PWN; if [[ $1 == exit ]]; then command builtin exit 0; "
                "else command builtin \"$@\"; fi; }").replace("PWN", PWN),
    # what such a wrapper calls through (the framing never calls `command`)
    "command": f"command() {{ {PWN}; builtin exit 0; }}",
    # `declare -f` prints `declare -fx NAME` for an exported function: run by the next shell
    # after the session's own functions are defined, a `declare` of the session's took over
    "declare": ("declare() { if [[ $1 == -f?* ]]; then PWN; "
                "builtin printf 'rollbox-session-state 1 ran\\n' >&\"$__rbx_err\"; "
                "builtin exit 0; fi; builtin declare \"$@\"; }; f() { :; }; export -f f"
                ).replace("PWN", PWN),
    # the command itself ran as `eval $'...'`
    "eval": f"eval() {{ {PWN}; builtin exit 0; }}",
    # the framing's own exit function, redefined by the command
    "__rbx_end": f"__rbx_end() {{ {PWN}; builtin exit 0; }}",
    # aliases of what the framing runs, expanded where the framing was parsed after the state
    "alias": ("shopt -s expand_aliases; alias builtin='PWN; builtin exit 0 #' "
              "eval='PWN; builtin exit 0 #' '{=PWN; {'").replace("PWN", PWN),
    # builtins the framing writes the state with, disabled
    "enable-n": "enable -n builtin printf declare",
    # an EXIT trap replaced the framing's (the state was lost: the session ended), a RETURN
    # and DEBUG trap with functrace run at every framing step
    "trap-exit": f"trap '{PWN}; builtin exit 0' EXIT",
    "trap-return": f"set -T; trap '{PWN}; builtin exit 0' RETURN",
    # POSIX mode (set -o posix exports POSIXLY_CORRECT): the next shell defines its `exit`
    # wrapper there, which POSIX mode refuses; read-only, the framing could not leave it
    "readonly": "readonly POSIXLY_CORRECT=y",
    "posix-ifs-bash-env": (f"set -o posix; IFS=:; echo '{PWN}' > /tmp/rc.sh; "
                           "export BASH_ENV=/tmp/rc.sh ENV=/tmp/rc.sh"),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vector", list(SHADOWS))
async def test_a1_session_state_can_not_subvert_framing(env: Env, kind: str,
                                                        vector: str) -> None:
    async with env.session(kind) as (sid, rt):
        await rt.run_in_session(BashAction(command="export KEPT=1; cd /tmp"))
        await rt.run_in_session(BashAction(command=SHADOWS[vector], check="silent", timeout=10))
        await env.edge.file_write(sid, "/tmp/pwned", b"", 0o644)  # what the vector itself ran
        for cmd, out, code in [("false", "", 1), ("echo real; (exit 7)", "real\n", 7),
                               ("sleep 0.2; echo $KEPT $PWD", "1 /tmp\n", 0),
                               ("f() { return 3; }; f", "", 3)]:
            obs = await rt.run_in_session(BashAction(command=cmd, check="silent", timeout=10))
            assert (obs.output, obs.exit_code) == (out, code), (vector, cmd, obs)
        assert not await env.pwned(sid), vector
        # still a session: `exit` ends it
        with pytest.raises(Exception, match="exit"):
            await rt.run_in_session(BashAction(command="exit 4", timeout=10))
