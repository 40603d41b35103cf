"""fncall backend on a real edge: languages, statuses, files, bad input, and calls that
misbehave (loop, fork bomb, memory bomb, huge output, leftovers) not reaching the next call."""
from __future__ import annotations

import asyncio
import base64
import time

import pytest

from rollbox.fncall import FnCallBackend, PoolConfig
from rollbox.fncall.pool import POLYGLOT_IMAGE
from rollbox.errors import BadRequest
from rollbox.models import FnCallSpec
from tests.conftest import have_image

pytestmark = pytest.mark.skipif(not have_image("fncall:1"),
                                reason="fncall:1 not built (run `make images`)")


def spec(language: str, code: str, **kw) -> FnCallSpec:  # noqa: ANN003
    return FnCallSpec(language=language, code=code, **kw)  # type: ignore[arg-type]


async def test_languages_statuses_and_files(edge) -> None:  # noqa: ANN001
    async with FnCallBackend(edge, PoolConfig(max_workers=3)) as fb:
        r = await fb.call(spec("python", "import sys; print(sys.stdin.read().upper())",
                               stdin="hi"))
        assert (r.status, r.exit_code, r.stdout) == ("ok", 0, "HI\n")
        assert r.wall_s > 0 and r.cpu_s >= 0
        r = await fb.call(spec("python", "raise ValueError('boom')"))
        assert r.status == "runtime_error" and r.exit_code == 1 and "ValueError: boom" in r.stderr
        r = await fb.call(spec("python", "import sys; sys.exit(3)"))
        assert (r.status, r.exit_code) == ("runtime_error", 3)
        r = await fb.call(spec("bash", "echo $((6*7)); id -u; echo err >&2"))
        assert r.status == "ok" and r.stdout == "42\n1000\n" and r.stderr == "err\n"
        r = await fb.call(spec("c", '#include <stdio.h>\nint main(){int x; scanf("%d",&x);'
                               'printf("%d\\n", x*2); return 0;}', stdin="21"))
        assert (r.status, r.stdout) == ("ok", "42\n") and r.compile and r.compile.exit_code == 0
        r = await fb.call(spec("cpp", "#include <iostream>\nint main(){std::cout<<\"cpp\";}"))
        assert (r.status, r.stdout) == ("ok", "cpp")
        r = await fb.call(spec("cpp", "int main( { }"))
        assert r.status == "compile_error" and "error" in r.compile.stderr  # type: ignore[union-attr]
        r = await fb.call(spec("nodejs", "console.log([1,2,3].map(x => x * 2).join(','))"))
        assert (r.status, r.stdout) == ("ok", "2,4,6\n")
        # files in, files out; the program sees only its own fresh directory
        files = {"data/in.txt": base64.b64encode(b"payload").decode()}
        r = await fb.call(spec("python", "import os\nprint(sorted(os.listdir('.')))\n"
                               "open('out.bin','wb').write(open('data/in.txt','rb').read()[::-1])",
                               files=files, fetch_files=["out.bin", "missing.txt"]))
        assert r.status == "ok" and "'data'" in r.stdout
        assert base64.b64decode(r.files["out.bin"]) == b"daolyap" and "missing.txt" not in r.files
        # outside the call dir: what the call wrote (/mnt, /tmp) comes back by its absolute
        # path; the image's files, the worker's, links and a later call never do
        r = await fb.call(spec("python", "open('/mnt/b','w').write('sauce')\n"
                               "open('/tmp/t','w').write('tmp')\n"
                               "import os; os.symlink('/etc/hostname', '/tmp/link')",
                               fetch_files=["/mnt/b", "/tmp/t", "/tmp/link", "/etc/passwd",
                                            "/proc/1/environ", "/mnt/../etc/passwd"]))
        assert r.status == "ok", r.stderr
        assert {k: base64.b64decode(v) for k, v in r.files.items()} == {
            "/mnt/b": b"sauce", "/tmp/t": b"tmp"}
        wrote = r.worker
        r = await fb.call(spec("python", "import os; print(os.listdir('/mnt'))",
                               fetch_files=["/mnt/b", "/tmp/t"]))
        assert (r.worker, r.status, r.stdout, r.files) == (wrote, "ok", "[]\n", {})
        r = await fb.call(spec("python", "open('nope.txt').read()"))
        assert r.status == "runtime_error" and "FileNotFoundError" in r.stderr
        # no network inside
        r = await fb.call(spec("python", "import socket\nsocket.create_connection(('1.1.1.1', 80), 2)"))
        assert r.status == "runtime_error"
        with pytest.raises(ValueError):
            spec("cobol", "x")
        go = spec("go", 'package main\nimport "fmt"\nfunc main() { fmt.Println(6 * 7) }',
                  compile_timeout_s=60)
        if not have_image(POLYGLOT_IMAGE):  # its languages are refused, naming the image
            with pytest.raises(BadRequest, match="ensure-polyglot"):
                await fb.call(go)
        else:  # the optional image is built on this node: its languages run
            r = await fb.call(go)
            assert (r.status, r.stdout) == ("ok", "42\n"), r
        with pytest.raises(ValueError):
            spec("python", "x", files={"../etc/passwd": ""})
        with pytest.raises(BadRequest):  # past the model's check, the worker still refuses
            await fb.call(spec("python", "x").model_copy(update={"files": {"a/../../b": ""}}))
        assert fb.stats()["workers"] <= 3


async def test_misbehaving_calls_do_not_reach_the_next(edge) -> None:  # noqa: ANN001
    # one pool per language: room for the python and the bash one
    async with FnCallBackend(edge, PoolConfig(max_workers=2)) as fb:
        base = await fb.call(spec("python", "print(1)"))
        worker = base.worker
        t0 = time.monotonic()
        bad = {
            "loop": spec("python", "while True: pass", timeout_s=1),
            "fork bomb": spec("python", "import os\nwhile True:\n  try: os.fork()\n"
                              "  except OSError: pass", timeout_s=2),
            "memory bomb": spec("python", "x = []\nwhile True: x.append(bytearray(1 << 24))",
                                memory_mib=128),
            "1 GB print": spec("python", "import sys\nb = 'x' * (1 << 20)\n"
                               "for _ in range(1024): sys.stdout.write(b)", timeout_s=20),
            "leftovers": spec("bash", "(sleep 1000 &) ; nohup sleep 1000 >/dev/null 2>&1 &\n"
                              "setsid sleep 1000 & echo s > /tmp/left; echo d > /dev/shm/left"),
            "bash fork bomb": spec("bash", ":(){ :|:& };:", timeout_s=2),
            # removal must not follow links and must get through dirs locked against it
            "locked tree": spec("bash", "mkdir -p a/b/c /tmp/left/u && echo x > a/b/c/f && "
                                "ln -s / a/root && ln -s /etc /tmp/left/etc && chmod 0 a/b/c "
                                "/tmp/left/u && chmod 500 a/b /tmp/left"),
        }
        statuses = {}
        for name, s in bad.items():
            r = await fb.call(s)
            statuses[name] = r.status
            after = time.monotonic()
            nxt = await fb.call(spec("python", "import os, glob\nprint(1)\n"
                                     "print(sorted(glob.glob('/tmp/left') + glob.glob('/dev/shm/left')))\n"
                                     "print(os.popen('ps -eo user= | sort | uniq -c').read())"))
            took = time.monotonic() - after
            assert nxt.status == "ok" and nxt.stdout.startswith("1\n[]\n"), (name, nxt)
            assert "1000" not in nxt.stdout.split("\n", 2)[2].replace(" 1000\n", ""), (name, nxt)
            # before the time bound: a replaced worker (a sandbox start) is seconds by itself
            assert nxt.worker == worker, (name, r.status, "the worker was replaced")
            assert took < 2.0, (name, r.status, took)  # ~0.02-0.13 s at load 15-45 here
        assert statuses["loop"] == "timeout"
        assert statuses["memory bomb"] == "memory_exceeded"
        assert statuses["leftovers"] == statuses["locked tree"] == "ok"
        big = await fb.call(spec("python", "import sys\nsys.stdout.write('y' * (3 << 20))",
                                 max_output_bytes=1000))
        assert big.truncated and len(big.stdout) == 1000 and big.stdout_bytes == 3 << 20
        assert time.monotonic() - t0 < 90


async def test_forked_python_state_does_not_reach_the_next(edge) -> None:  # noqa: ANN001
    """Python calls reuse the worker's stdio objects and base environment in their fork: what
    one call sets (env, std streams, cwd, modules, files) is gone in the next."""
    async with FnCallBackend(edge, PoolConfig(max_workers=1)) as fb:
        first = await fb.call(spec(
            "python", "import os, sys\nprint(os.environ['X'], os.environ['HOME'] == os.getcwd())\n"
            "os.environ['LEAK'] = '1'; sys.modules['leak'] = sys\nopen('f', 'w').write('x')\n"
            "sys.stdout.write('partial'); print('e1', file=sys.stderr); sys.stdout.close()",
            env={"X": "from-call"}))
        assert first.status == "ok", first
        assert first.stdout == "from-call True\npartial" and first.stderr == "e1\n"
        for _ in range(2):
            nxt = await fb.call(spec(
                "python", "import os, sys\nprint(sorted(k for k in os.environ if k in "
                "('X', 'LEAK')), 'leak' in sys.modules, os.listdir('.'), sys.argv[1:])\n"
                "print(sys.stdin.read(), end='')\nprint('e2', file=sys.stderr)",
                stdin="in\n", args=["a"]))
            assert nxt.status == "ok" and nxt.worker == first.worker, nxt
            assert nxt.stdout == "[] False ['main.py'] ['a']\nin\n" and nxt.stderr == "e2\n"
        calls = [e for e in edge.event_log.read_sync(first.worker) if e.kind == "fncall.call"]
        assert len(calls) == 3 and '"status":"ok"' in calls[0].data, calls
        assert "from-call" not in calls[0].data  # what ran is counted, never copied


async def test_workers_belong_to_no_project(edge) -> None:  # noqa: ANN001
    """Workers run every project's calls: their owner is no project name a key can have
    (a project named "fncall" listed them and could exec into them)."""
    from rollbox.fncall.pool import WORKER_OWNER
    from rollbox.iam.keys import PROJECT_RE

    async with FnCallBackend(edge, PoolConfig(max_workers=1)) as fb:
        assert (await fb.call(spec("bash", "true"))).status == "ok"
        workers = await edge.list(None, {"rollbox.backend": "fncall"})
        assert workers and {w.owner for w in workers} == {WORKER_OWNER}
        assert not PROJECT_RE.match(WORKER_OWNER)
        assert await edge.list("fncall", {}) == []



async def test_a_cancelled_worker_start_leaves_no_worker_and_no_sandbox(edge) -> None:  # noqa: ANN001
    """A prewarm given up on while its worker's sandbox is created, then while its worker
    process starts: it ends cancelled, the sandbox is gone, and the pool counts no worker
    (it counted the one that never came, and with the cap reached a call then waited
    forever)."""
    async with FnCallBackend(edge, PoolConfig(max_workers=1, min_idle=0)) as fb:
        points = [("its sandbox created", lambda: [i.id for i, _, _ in edge.journal.live()
                                                  if i.state == "creating"]),
                  ("its worker starting", lambda: list(edge.live))]
        for point, seen in points:
            prewarm = asyncio.ensure_future(fb.prewarm("python", 1))
            for _ in range(6000):
                if seen() or prewarm.done():
                    break
                await asyncio.sleep(0.01)
            ids = seen()
            assert ids and not prewarm.done(), f"{point}: not seen before the prewarm ended"
            prewarm.cancel()
            with pytest.raises(asyncio.CancelledError):
                await prewarm
            assert fb.stats()["workers"] == 0, point
            assert [p["size"] for p in fb.stats()["pools"]] == [0], point
            assert edge.journal.live() == [] and not edge.live, point
            assert [edge.leftovers(sid) for sid in ids] == [[]], point
        async with asyncio.timeout(120):  # the cap's one worker is free again
            r = await fb.call(spec("python", "print(6 * 7)"))
        assert (r.status, r.stdout) == ("ok", "42\n")
