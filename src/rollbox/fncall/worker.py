"""The in-sandbox fncall worker: a fork-server that serves one call at a time.

Never imported by the host. Its *source* is passed to the image's own ``python3 -I -c`` (from the
read-only image layer) as the argv of one long-running exec, so nothing of the sandbox's writable
tree runs for the platform. The control channel is that exec's stdin/stdout (frames: 4-byte
big-endian length + JSON); the worker dups them away from fds 0-2, and every call runs as an
unprivileged uid that can neither ptrace the worker (non-dumpable, other uid) nor reach its fds.

Per call: a fresh directory ``/var/lib/rollbox-fncall/c<n>`` owned by the call uid, rlimits, an optional compile
step, the run (Python calls are forked from this preloaded interpreter and exec'd in-process;
other languages exec their binary), bounded output capture, then every process of the call uid
is killed (``kill(-1)`` as that uid until none is left; orphans are reaped here as subreaper)
and its files are removed (its directory and anything it left in the world-writable dirs).
"""
import _signal
import base64
import builtins
import ctypes
import io  # noqa: F401 - loaded before any fork (calls' children inherit it)
import json
import os
import resource
import select
import signal
import struct
import sys
import time
import traceback

# Beneath an image directory: Landlock grants the worker only entries that existed at its exec.
CALL_ROOT = "/var/lib/rollbox-fncall"
# /mnt: SandboxFusion's runs write scratch output there (each of its runs has a private
# root); here it is world-writable and sticky like /tmp, emptied of the call's files after it.
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/mnt")
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1
LEN = struct.Struct(">I")
# Compiled languages of the optional image (fncall-polyglot:1): source file, build argv, run
# argv, whether the run gets an address-space limit (the JVM reserves far more than it uses).
COMPILED = {
    "go": ("main.go", ["go", "build", "-o", "main", "main.go"], ["./main"], False),
    "java": ("Main.java", ["javac", "-cp", ".", "Main.java"], ["java", "-cp", ".", "-ea", "Main"],
             False),
    "rust": ("main.rs", ["rustc", "-o", "main", "main.rs"], ["./main"], True),
}
# TypeScript's build step: every .ts file of the call dir transpiled to .js by Debian's
# typescript package (no type check, like SandboxFusion's tsx); then node runs main.js.
TS_TRANSPILE = (
    "const ts = require('typescript'), fs = require('fs');"
    "for (const f of fs.readdirSync('.')) { if (!f.endsWith('.ts')) continue;"
    "fs.writeFileSync(f.slice(0, -3) + '.js', ts.transpileModule(fs.readFileSync(f, 'utf8'), "
    "{compilerOptions: {module: ts.ModuleKind.CommonJS, target: ts.ScriptTarget.ES2020, "
    "esModuleInterop: true}, fileName: f}).outputText); }"
)
LIBC = ctypes.CDLL(None, use_errno=True)
# Typed once here: an untyped ctypes call in a fresh fork touches (copies) many more pages.
PRCTL = LIBC.prctl
PRCTL.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
PRCTL.restype = ctypes.c_int
# Plain ints and the C-level ``_signal.signal``: ``signal.signal`` goes through the enum
# machinery, ~80 copy-on-write page faults per fork.
DEFAULT_SIGNALS = tuple(int(s) for s in (signal.SIGPIPE, signal.SIGINT, signal.SIGTERM,
                                         signal.SIGCHLD))
SIG_DFL = int(signal.SIG_DFL)
MEMORY_MARKERS = (b"MemoryError", b"std::bad_alloc", b"JavaScript heap out of memory",
                  b"Cannot allocate memory", b"out of memory")


def read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def send(fd, obj):
    data = json.dumps(obj, separators=(",", ":")).encode()
    view = memoryview(LEN.pack(len(data)) + data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def vm_size_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


class Worker:
    def __init__(self, cfg):
        self.uid = int(cfg["call_uid"])
        self.n = 0
        # True once kill_all found no process of the call uid after the call's last spawn:
        # only the worker forks call processes, so none can have appeared since.
        self.none_left = False
        self.baseline_vm = 0
        self.env = dict(cfg.get("env") or {})

    # ---- process plumbing -------------------------------------------------------------
    def child_setup(self, cwd, stdin_fd, out_w, err_w, memory, nproc, fsize, cpu_s, as_limit):
        """In the forked child, before running anything of the call."""
        os.setsid()
        PRCTL(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # SIGKILL
        for sig in DEFAULT_SIGNALS:
            _signal.signal(sig, SIG_DFL)
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 65536)
        try:  # the call, not the worker, is what the OOM killer takes (os.open: no io stack)
            fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
            try:
                os.write(fd, b"1000")
            finally:
                os.close(fd)
        except OSError:
            pass
        if as_limit:
            resource.setrlimit(resource.RLIMIT_AS, (as_limit, as_limit))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        os.setgroups([])
        os.setresgid(self.uid, self.uid, self.uid)
        os.setresuid(self.uid, self.uid, self.uid)
        os.chdir(cwd)
        os.umask(0o022)

    def spawn(self, cwd, argv, stdin_data, timeout, memory_mib, max_output, env, py_code=None,
              virtual_mem=True):
        """Run one process of the call; returns a dict with exit, signal, outputs, times."""
        stdin_fd = os.memfd_create("stdin", 0)
        if stdin_data:
            os.write(stdin_fd, stdin_data)
            os.lseek(stdin_fd, 0, os.SEEK_SET)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        mem = memory_mib << 20
        if py_code is not None:
            as_limit = self.baseline_vm + mem
        else:
            as_limit = mem if virtual_mem else 0
        cpu = max(1, int(timeout) + 1)
        t0 = time.monotonic()
        self.none_left = False
        pid = os.fork()
        if pid == 0:
            try:
                self.child_setup(cwd, stdin_fd, out_w, err_w, mem, 64, 256 << 20, cpu, as_limit)
                if py_code is not None:
                    run_python(py_code, cwd, env)
                os.execvpe(argv[0], argv, env)
            except BaseException as exc:  # noqa: BLE001
                try:
                    os.write(2, f"fncall: cannot start {argv[0]}: {exc}\n".encode())
                except OSError:
                    pass
            os._exit(127)
        os.close(out_w)
        os.close(err_w)
        os.close(stdin_fd)
        deadline = t0 + timeout
        pidfd = os.pidfd_open(pid)
        bufs = {out_r: bytearray(), err_r: bytearray()}
        totals = {out_r: 0, err_r: 0}
        open_fds = {out_r, err_r}
        status = None
        rusage = None
        timed_out = False
        drain_until = None
        poller = select.poll()
        for fd in (out_r, err_r, pidfd):
            poller.register(fd, select.POLLIN)
        while True:
            now = time.monotonic()
            if status is not None and (now >= drain_until or not open_fds):
                break
            if status is None and now >= deadline:
                timed_out = True
                break
            limit = (drain_until if status is not None else deadline) - now
            for fd, _ev in poller.poll(max(0.0, limit) * 1000 + 1):
                if fd == pidfd:
                    poller.unregister(pidfd)
                    _, status, rusage = os.wait4(pid, 0)
                    # what it left behind may hold the pipes open: drain briefly, no more
                    drain_until = time.monotonic() + 0.02
                    continue
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    data = b""
                if not data:
                    poller.unregister(fd)
                    open_fds.discard(fd)
                    continue
                totals[fd] += len(data)
                room = max_output - len(bufs[fd])
                if room > 0:
                    bufs[fd] += data[:room]
        os.close(pidfd)
        wall = time.monotonic() - t0
        reaped = self.kill_all()
        if status is None and pid in reaped:
            status, rusage = reaped[pid]
        os.close(out_r)
        os.close(err_r)
        exit_code, sig = None, None
        if status is not None:
            if os.WIFEXITED(status):
                exit_code = os.WEXITSTATUS(status)
            elif os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
        cpu_s = (rusage.ru_utime + rusage.ru_stime) if rusage is not None else 0.0
        return {"exit_code": exit_code, "signal": sig, "timed_out": timed_out,
                "stdout": bytes(bufs[out_r]), "stderr": bytes(bufs[err_r]),
                "stdout_bytes": totals[out_r], "stderr_bytes": totals[err_r],
                "wall_s": wall, "cpu_s": cpu_s}

    def kill_all(self):
        """SIGKILL every process of the call uid (setsid, double-fork, nohup included): scan
        the sandbox's /proc for processes whose real uid is the call uid, kill them, reap the
        orphans that come to this subreaper, repeat until none is left (RLIMIT_NPROC bounds a
        fork bomb, so this converges). ``kill(-1)`` can't say "none left": it succeeds while
        any other process exists."""
        reaped = {}
        me = os.getpid()
        for _ in range(1000):
            found = 0
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) in (1, me):
                    continue
                try:
                    with open(f"/proc/{name}/status", "rb") as f:
                        status = f.read()
                except OSError:
                    continue
                i = status.find(b"\nUid:")
                if i < 0 or int(status[i + 5:].split(None, 1)[0]) != self.uid:
                    continue
                found += 1
                try:
                    os.kill(int(name), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            while True:
                try:
                    pid, st, ru = os.wait4(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                reaped[pid] = (st, ru)
            if not found:
                self.none_left = True
                return reaped
            time.sleep(0.0005)
        raise RuntimeError("processes of the call survive SIGKILL")

    # ---- files --------------------------------------------------------------------------
    def make_call_dir(self):
        """Root-owned while the worker fills it; handed to the call uid by ``hand_over``."""
        self.n += 1
        path = f"{CALL_ROOT}/c{self.n}"
        os.mkdir(path, 0o700)
        return path

    def hand_over(self, cwd):
        os.chown(cwd, self.uid, self.uid)

    def write_files(self, cwd, files):
        for name, b64 in files.items():
            rel = os.path.normpath(name)
            if name.startswith("/") or rel.startswith("..") or rel in (".", ""):
                raise ValueError(f"file path must be relative, inside the call dir: {name!r}")
            parent = cwd
            for part in rel.split("/")[:-1]:
                parent = os.path.join(parent, part)
                if not os.path.isdir(parent):
                    os.mkdir(parent, 0o755)
                    os.chown(parent, self.uid, self.uid)
            path = os.path.join(cwd, rel)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(base64.b64decode(b64 or ""))
            os.chown(path, self.uid, self.uid)

    def clean(self, cwd):
        if not self.none_left:
            self.kill_all()
        remove_owned(cwd, self.uid)
        if os.path.lexists(cwd):
            raise RuntimeError(f"call dir {cwd} could not be removed")

    # ---- one call -------------------------------------------------------------------------
    def call(self, req):
        lang = req["language"]
        cwd = self.make_call_dir()
        try:
            return self._call(req, lang, cwd)
        finally:
            self.clean(cwd)

    def _call(self, req, lang, cwd):
        try:
            self.write_files(cwd, req.get("files") or {})
        except (ValueError, OSError) as exc:
            return {"error": "bad_request", "message": f"files: {exc}"}
        code = req["code"]
        stdin = base64.b64decode(req.get("stdin") or "")
        timeout = float(req["timeout_s"])
        memory = int(req["memory_mib"])
        max_out = int(req["max_output"])
        env = dict(self.env)
        env.update({"HOME": cwd, "TMPDIR": cwd, "PWD": cwd})
        env.update(req.get("env") or {})
        args = list(req.get("args") or [])
        if os.path.realpath(cwd) != cwd:
            return {"error": "infrastructure", "message": "call dir is not canonical"}
        compile_res = None
        if lang not in ("python", "bash", "nodejs", "c", "cpp", "typescript", *COMPILED):
            return {"error": "bad_request", "message": f"unknown language {lang!r}"}
        if lang == "python":
            main = os.path.join(cwd, "main.py")
            self._source(cwd, "main.py", code)
            self.hand_over(cwd)
            run = self.spawn(cwd, ["python3"], stdin, timeout, memory, max_out, env,
                             py_code=(code, main, args))
        elif lang == "bash":
            self._source(cwd, "main.sh", code)
            self.hand_over(cwd)
            run = self.spawn(cwd, ["bash", "main.sh", *args], stdin, timeout, memory, max_out,
                             env)
        elif lang == "nodejs":
            self._source(cwd, "main.js", code)
            self.hand_over(cwd)
            argv = ["node", f"--max-old-space-size={max(16, memory - 32)}", "main.js", *args]
            run = self.spawn(cwd, argv, stdin, timeout, memory, max_out, env, virtual_mem=False)
        elif lang in ("c", "cpp"):
            src = "main.c" if lang == "c" else "main.cpp"
            self._source(cwd, src, code)
            self.hand_over(cwd)
            cc = ["gcc", "-std=gnu17"] if lang == "c" else ["g++", "-std=gnu++17"]
            argv = [*cc, "-O2", "-pipe", "-o", "main", src, *(req.get("compile_flags") or []),
                    "-lm"]
            compile_res = self.spawn(cwd, argv, b"", float(req["compile_timeout_s"]),
                                     max(memory, 1024), max_out, env, virtual_mem=False)
            if compile_res["exit_code"] != 0:
                return {"status": "timeout" if compile_res["timed_out"] else "compile_error",
                        "compile": self._wire(compile_res), "run": None}
            run = self.spawn(cwd, ["./main", *args], stdin, timeout, memory, max_out, env)
        elif lang in COMPILED or lang == "typescript":  # fncall-polyglot:1's toolchains
            if lang == "typescript":
                src, build, vm = "main.ts", ["node", "-e", TS_TRANSPILE], False
                runner = ["node", f"--max-old-space-size={max(16, memory - 32)}", "main.js"]
            else:
                src, build, runner, vm = COMPILED[lang]
            self._source(cwd, src, code)
            self.hand_over(cwd)
            # Toolchain caches (Go's build cache) in the call's own directory.
            env.update({"GOCACHE": os.path.join(cwd, ".cache", "go"), "GOPATH": cwd,
                        "GOFLAGS": "-buildvcs=false", "GOTOOLCHAIN": "local"})
            compile_res = self.spawn(cwd, build, b"", float(req["compile_timeout_s"]),
                                     max(memory, 1024), max_out, env, virtual_mem=False)
            if compile_res["exit_code"] != 0:
                return {"status": "timeout" if compile_res["timed_out"] else "compile_error",
                        "compile": self._wire(compile_res), "run": None}
            run = self.spawn(cwd, [*runner, *args], stdin, timeout, memory, max_out, env,
                             virtual_mem=vm)
        else:
            return {"error": "bad_request", "message": f"unknown language {lang!r}"}
        return {"status": self._status(run), "run": self._wire(run),
                "compile": self._wire(compile_res) if compile_res else None,
                "files": self._fetch(cwd, req.get("fetch_files") or [], self.uid)}

    @staticmethod
    def _fetch(cwd, names, uid, budget=8 << 20):
        """Regular files the call may hand back: beneath the call dir (a relative name), or
        an absolute path elsewhere (e.g. /tmp, /mnt) naming a file the call's own uid owns,
        so a call fetches what it wrote, never the image's or the worker's files. Each
        component is opened O_NOFOLLOW from its parent's fd, so no link leads anywhere else.
        Bounded in total."""
        out = {}
        for name in names:
            if not isinstance(name, str) or "\0" in name:
                continue
            rel = os.path.relpath(name, cwd) if name.startswith(cwd + "/") else name
            outside = rel.startswith("/")
            parts = [p for p in os.path.normpath(rel).split("/") if p not in ("", ".")]
            if not parts or ".." in parts:
                continue
            fds = [os.open("/" if outside else cwd, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)]
            try:
                for part in parts[:-1]:
                    fds.append(os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW,
                                       dir_fd=fds[-1]))
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK,
                             dir_fd=fds[-1])
                fds.append(fd)
                st = os.fstat(fd)
                if st.st_mode & 0o170000 != 0o100000 or st.st_size > budget \
                        or (outside and st.st_uid != uid):
                    continue
                data = os.read(fd, st.st_size + 1)[:budget]
                budget -= len(data)
                out[name] = base64.b64encode(data).decode()
            except OSError:
                continue
            finally:
                for fd in fds:
                    os.close(fd)
        return out

    def _source(self, cwd, name, code):
        path = os.path.join(cwd, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(code)
        os.chown(path, self.uid, self.uid)

    @staticmethod
    def _status(run):
        if run["timed_out"]:
            return "timeout"
        if run["exit_code"] == 0:
            return "ok"
        if run["signal"] == signal.SIGKILL or any(m in run["stderr"] for m in MEMORY_MARKERS):
            return "memory_exceeded"  # SIGKILL we did not send: the OOM killer
        if run["signal"] == signal.SIGXCPU:
            return "timeout"
        return "runtime_error"

    @staticmethod
    def _wire(res):
        out = dict(res)
        out["stdout"] = base64.b64encode(res["stdout"]).decode()
        out["stderr"] = base64.b64encode(res["stderr"]).decode()
        return out


def remove_owned(cwd, uid):
    """Remove the call's directory and what its uid left in the world-writable dirs."""
    def rm(path):
        if not remove_flat(path):
            remove_tree(path)

    try:
        os.chmod(cwd, 0o700)
    except OSError:
        pass
    if os.path.lexists(cwd):
        rm(cwd)
    for d in WORLD_WRITABLE:
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                if e.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if e.is_dir(follow_symlinks=False):
                    rm(e.path)
                else:
                    os.unlink(e.path)
            except OSError:
                pass


def remove_tree(path):
    """``shutil.rmtree(path, ignore_errors=True)`` without shutil, whose import drags in zlib,
    bz2 and lzma: ~30 more mappings that every call's fork copies and tears down. Links are
    never followed (each directory is opened O_NOFOLLOW from its parent's fd) and each
    directory is made writable first (a call may have locked its dirs to block removal); the
    call's processes are all dead by now, so nothing moves underneath. What cannot be removed
    stays, for the caller to notice."""
    parent, name = os.path.split(path)
    try:
        pfd = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        _remove_at(pfd, name)
    finally:
        os.close(pfd)


def _remove_at(dfd, name):
    try:
        os.unlink(name, dir_fd=dfd)
        return
    except IsADirectoryError:
        pass
    except OSError:
        return
    try:
        os.chmod(name, 0o700, dir_fd=dfd)
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
    except OSError:
        return
    try:
        with os.scandir(fd) as it:
            names = [e.name for e in it]
        for n in names:
            _remove_at(fd, n)
    except OSError:
        pass
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dfd)
    except OSError:
        pass


def remove_flat(path):
    """The common case, a directory of files only: one scandir, unlinks, rmdir. False (nothing
    assumed) when it holds a directory or anything fails; the caller then walks it."""
    try:
        with os.scandir(path) as it:
            entries = list(it)
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                return False
        for e in entries:
            os.unlink(e.path)
        os.rmdir(path)
    except OSError:
        return False
    return True


def run_python(py_code, cwd, env):
    """In the forked child: run the call's Python in this (preloaded) interpreter.

    The worker's environment already is the base one (``main``) and its ``sys.std*`` objects
    are empty and bound to fds 0-2, which ``child_setup`` pointed at the call's stdin and pipes:
    setting only what differs and reusing them spares the fork ~250 copied pages."""
    code, path, args = py_code
    environ = os.environ
    for k in [k for k in environ if k not in env]:
        del environ[k]
    for k, v in env.items():
        if environ.get(k) != v:
            environ[k] = v
    sys.argv = [path, *args]
    sys.path.insert(0, cwd)
    glb = {"__name__": "__main__", "__file__": path, "__builtins__": builtins}
    rc = 0
    try:
        exec(compile(code, path, "exec"), glb)  # noqa: S102 - running the caller's code is the job
    except SystemExit as exc:
        c = exc.code
        if c is None:
            rc = 0
        elif isinstance(c, int):
            rc = c & 0xFF
        else:
            print(c, file=sys.stderr)
            rc = 1
    except BaseException:  # noqa: BLE001
        try:
            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
        rc = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    os._exit(rc)


def main():
    cfg = json.loads(sys.argv[1])
    LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    ctl_in, ctl_out = os.dup(0), os.dup(1)  # non-inheritable: no call ever sees them
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    # The calls' base environment (each call sets only its own keys over it, see run_python);
    # stdio objects empty and stderr line-buffered, reused by forked Python calls.
    os.environ.clear()
    os.environ.update(cfg.get("env") or {})
    sys.stderr.reconfigure(line_buffering=True)
    os.makedirs(CALL_ROOT, 0o711, exist_ok=True)
    os.chmod(CALL_ROOT, 0o711)
    os.makedirs("/mnt", exist_ok=True)
    os.chmod("/mnt", 0o1777)  # see WORLD_WRITABLE
    sys.path = [p for p in sys.path if p not in ("", ".")]
    failed = []
    import importlib

    for mod in cfg.get("preload") or []:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # noqa: BLE001
            failed.append(f"{mod}: {exc}")
    worker = Worker(cfg)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # what preloads printed went to /dev/null, never into a call's output
    import gc

    gc.collect()
    gc.freeze()  # preloaded objects stay shared with the forked calls (no CoW by refcounts)
    worker.baseline_vm = vm_size_bytes()
    send(ctl_out, {"ready": True, "pid": os.getpid(), "preload_failed": failed,
                   "python": sys.version.split()[0]})
    while True:
        try:
            (n,) = LEN.unpack(read_exact(ctl_in, 4))
            req = json.loads(read_exact(ctl_in, n))
        except EOFError:
            return
        try:
            res = worker.call(req)
        except Exception as exc:  # noqa: BLE001 - reported, the host replaces the worker
            res = {"error": "infrastructure", "message": f"worker: {type(exc).__name__}: {exc}"}
        res["id"] = req.get("id")
        send(ctl_out, res)


if __name__ == "__main__":
    main()
