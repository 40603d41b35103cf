"""A PostgreSQL server of our own for a cluster (and for tests): :class:`PostgresServer`.

Owns one data directory and the ``postgres`` process that serves it: ``initdb`` once (as the
``postgres`` system user: initdb refuses root), a start that listens on loopback and a unix
socket only, waits until it answers, makes the ``rollbox`` role and database (password auth,
SCRAM; the password is generated once and kept in the data directory, mode 0600), and a stop
that leaves no process behind, also when the start failed. Uses Debian's binaries
(``/usr/lib/postgresql/<major>/bin``, package ``postgresql``). Knows nothing of what the
database holds (``rollbox.iam.postgres`` makes its tables).
"""
from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from rollbox import errors

PG_USER = "postgres"
DB_NAME = "rollbox"
DB_ROLE = "rollbox"
PASSWORD_FILE = "rollbox.password"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


def pg_bindir() -> Path:
    """The newest installed PostgreSQL's binaries (InfraError if none is installed)."""
    root = Path("/usr/lib/postgresql")
    found = sorted((d for d in root.glob("*/bin") if (d / "postgres").exists()),
                   key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else 0)
    if not found:
        raise errors.InfraError("PostgreSQL is not installed (apt-get install postgresql)")
    return found[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """``PostgresServer(data_dir, port, socket_dir)``: ``port`` None = unix socket only.
    ``socket_dir`` (default: ``<data_dir>.sock`` beside it) is made by the start, owned by the
    ``postgres`` user. ``start()`` (idempotent over an existing data dir: no second initdb),
    ``dsn``, ``stop()``; also a context manager. Every directory above ``data_dir`` and
    ``socket_dir`` must be traversable by the ``postgres`` user (a 0700 pytest tmp dir is not:
    BadRequest)."""

    def __init__(self, data_dir: Path, port: int | None = None,
                 socket_dir: Path | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.port = port
        self.socket_dir = (Path(socket_dir) if socket_dir is not None
                           else self.data_dir.parent / f"{self.data_dir.name}.sock")
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"
        self._pw = pwd.getpwnam(PG_USER)
        self._bin = pg_bindir()
        # The server's own port number also names its socket file (.s.PGSQL.<port>); with no
        # TCP port it is still needed for that name: one that is free now.
        self._sock_port = port if port is not None else _free_port()

    # ---- paths and credentials -------------------------------------------------------
    @property
    def password(self) -> str:
        return (self.data_dir / PASSWORD_FILE).read_text().strip()

    @property
    def dsn(self) -> str:
        """What asyncpg connects with: TCP loopback if the server has a port, else its
        unix socket."""
        if self.port is not None:
            return (f"postgresql://{DB_ROLE}:{self.password}@127.0.0.1:{self.port}/{DB_NAME}")
        return (f"postgresql://{DB_ROLE}:{self.password}@/{DB_NAME}"
                f"?host={self.socket_dir}&port={self._sock_port}")

    def _check_reachable(self, path: Path) -> None:
        for p in [path, *path.parents]:
            if p.exists() and not os.stat(p).st_mode & 0o001 and os.stat(p).st_uid != \
                    self._pw.pw_uid:
                raise errors.BadRequest(f"{p} is not traversable by the {PG_USER} user: put "
                                        "the PostgreSQL data and socket dirs elsewhere",
                                        path=str(p))

    def _socket_dir(self) -> None:
        """The socket dir: made here (the postgres user's, 0700: only it and root connect
        through it); an existing one must be the postgres user's already."""
        try:
            self.socket_dir.mkdir(mode=0o700)
            os.chown(self.socket_dir, self._pw.pw_uid, self._pw.pw_gid)
        except FileExistsError:
            if self.socket_dir.stat().st_uid != self._pw.pw_uid:
                raise errors.BadRequest(f"socket dir {self.socket_dir} exists and is not the "
                                        f"{PG_USER} user's", path=str(self.socket_dir)) from None

    def _as_postgres(self, argv: list[str], **kw: object) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(argv, user=self._pw.pw_uid, group=self._pw.pw_gid,
                              extra_groups=[], capture_output=True, cwd="/",
                              **kw)  # type: ignore[call-overload]

    # ---- life -------------------------------------------------------------------------
    def initialised(self) -> bool:
        return (self.data_dir / "PG_VERSION").exists()

    def _initdb(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chown(self.data_dir, self._pw.pw_uid, self._pw.pw_gid)
        self.data_dir.chmod(0o700)
        pwfile = self.data_dir.parent / f".{self.data_dir.name}.pw-{secrets.token_hex(4)}"
        password = secrets.token_urlsafe(24)
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, password.encode() + b"\n")
            os.close(fd)
            os.chown(pwfile, self._pw.pw_uid, self._pw.pw_gid)
            res = self._as_postgres([str(self._bin / "initdb"), "-D", str(self.data_dir),
                                     "-U", PG_USER, "--pwfile", str(pwfile),
                                     "-A", "scram-sha-256", "-E", "UTF8", "--no-instructions"])
        finally:
            pwfile.unlink(missing_ok=True)
        if res.returncode != 0:
            raise errors.InfraError(f"initdb failed: {res.stderr.decode(errors='replace')[-2000:]}")
        (self.data_dir / PASSWORD_FILE).write_text(password + "\n")
        (self.data_dir / PASSWORD_FILE).chmod(0o600)  # root's: postgres need not read it

    def start(self) -> PostgresServer:
        """initdb if needed, start, wait until it answers, make the role and database.
        On any failure the server is stopped before the error is raised."""
        if self.proc is not None:
            return self
        self._check_reachable(self.data_dir.parent)
        self._check_reachable(self.socket_dir.parent)
        if not self.initialised():
            self._initdb()
        self._socket_dir()
        listen = "127.0.0.1" if self.port is not None else ""
        argv = [str(self._bin / "postgres"), "-D", str(self.data_dir),
                "-p", str(self._sock_port), "-k", str(self.socket_dir),
                "-c", f"listen_addresses={listen}", "-c", "max_connections=200",
                "-c", "shared_buffers=32MB", "-c", "fsync=on", "-c", "logging_collector=off"]
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = subprocess.Popen(argv, user=self._pw.pw_uid, group=self._pw.pw_gid,
                                         extra_groups=[], stdout=log, stderr=log, cwd="/",
                                         start_new_session=True)
        finally:
            log.close()
        try:
            self._wait_ready()
            self._bootstrap()
        except BaseException:
            self.stop()
            raise
        return self

    def _psql(self, sql: str, db: str = "postgres") -> str:
        res = self._as_postgres(
            [str(self._bin / "psql"), "-h", str(self.socket_dir), "-p", str(self._sock_port), "-U", PG_USER,
             "-d", db, "-v", "ON_ERROR_STOP=1", "-tAc", sql],
            env={"PGPASSWORD": self._superuser_password(), "PATH": "/usr/bin:/bin"})
        if res.returncode != 0:
            raise errors.InfraError(f"psql failed: {res.stderr.decode(errors='replace')[-1000:]}")
        return res.stdout.decode().strip()

    def _superuser_password(self) -> str:
        return self.password  # initdb gave the superuser the same generated password

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise errors.InfraError(f"postgres exited ({self.proc.returncode}): "
                                        f"{self.log_tail()}")
            res = self._as_postgres([str(self._bin / "pg_isready"), "-q", "-h",
                                     str(self.socket_dir), "-p", str(self._sock_port)])
            if res.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise errors.InfraError(f"postgres not ready after {START_TIMEOUT_S:g} s: "
                                        f"{self.log_tail()}")
            time.sleep(0.05)

    def _bootstrap(self) -> None:
        pw = self.password.replace("'", "''")
        if self._psql(f"SELECT 1 FROM pg_roles WHERE rolname='{DB_ROLE}'") != "1":
            self._psql(f"CREATE ROLE {DB_ROLE} LOGIN PASSWORD '{pw}'")
        if self._psql(f"SELECT 1 FROM pg_database WHERE datname='{DB_NAME}'") != "1":
            self._psql(f"CREATE DATABASE {DB_NAME} OWNER {DB_ROLE}")

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Fast shutdown (SIGINT), SIGKILL to the server's whole process group after
        STOP_TIMEOUT_S; returns once no process of it is left."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(STOP_TIMEOUT_S)
                return
            except subprocess.TimeoutExpired:
                pass
        # The backends are in the postmaster's session and process group (not yet reaped:
        # the group id is still ours).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def destroy(self) -> None:
        """Stop and remove the data dir, its socket dir and its log (tests)."""
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
