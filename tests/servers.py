"""Throwaway PostgreSQL and Redis servers for the test suite.

The suite needs real servers (the engine's guarantees are about PostgreSQL transactions and
broker redelivery, which fakes would not exercise), and it needs to restart and kill them while
work is in flight. So each server here is a private process on a free loopback port with its
data in a temp dir, started once per pytest session (see ``conftest.py``).

Design notes:

* Servers listen only on 127.0.0.1 (never a wildcard address) and PostgreSQL's unix socket
  lives in the temp dir, so nothing collides with a system cluster or another test session.
* PostgreSQL refuses to run as root. When we are root, ``initdb`` and ``postgres`` run as the
  ``postgres`` OS user via ``subprocess.Popen(user=..., group=...)``. ``runuser`` is avoided
  for the long-lived server: it sits between us and the postmaster and turns our shutdown
  signal into SIGTERM (PostgreSQL's "smart" shutdown, which waits for clients) and then SIGKILL
  two seconds later. Running ``postgres`` directly makes ``Popen.pid`` the postmaster, so
  SIGINT is exactly a fast shutdown.
* Servers run in their own session (``start_new_session``) so a Ctrl-C in the terminal or a test
  that signals its own process group does not take them down behind the fixtures' back.
* Leftovers: servers are stopped on ``atexit``. If the test process dies without running atexit
  (SIGKILL, OOM, a hard timeout), a tiny ``sh`` watchdog per server notices within a second,
  shuts the server down and removes its temp dir.
* PgBouncer refuses to run as root as well: it runs as ``postgres`` the same way.
* ``restart()`` keeps the port and the data dir, so URLs handed out before stay valid.
  Redis runs without persistence, so a Redis restart also empties it (a lost broker).
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import psycopg
import redis
from psycopg import sql

__all__ = [
    "PgBouncer",
    "PostgresServer",
    "RedisServer",
    "ServerError",
    "StandbyServer",
    "default_base_dir",
    "find_pg_bindir",
    "free_port",
]

LOOPBACK = "127.0.0.1"


class ServerError(RuntimeError):
    """A test server failed to start or stop; the message carries the tail of its log."""


def default_base_dir() -> Path | None:
    """Where server temp dirs go: ``$DUCTOR_TEST_TMPDIR``, else /dev/shm if roomy, else TMPDIR.

    On a disk-backed /tmp, CREATE DATABASE from a template took ~0.5 s on the dev VM; on tmpfs
    ~0.02-0.04 s, and the suite creates a database per test. /dev/shm is only used when it has
    at least 2 GiB free: containers often cap it at 64 MB.
    """
    if env := os.environ.get("DUCTOR_TEST_TMPDIR"):
        return Path(env)
    shm = Path("/dev/shm")
    with contextlib.suppress(OSError):
        st = os.statvfs(shm)
        if st.f_bavail * st.f_frsize >= 2 << 30 and os.access(shm, os.W_OK | os.X_OK):
            return shm
    return None  # tempfile's default


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago.

    Another process may grab it before the server binds; ``start()`` retries with a new port
    when the server reports "Address already in use" on its first start.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        port: int = s.getsockname()[1]
        return port


# Runs detached next to each server. Arguments: owner pid, server pid, signal name, temp dir.
# While the owner (the pytest process) lives it only polls; it exits quietly when the server
# goes away on its own. When the owner vanishes it stops the server, escalates to SIGKILL after
# ten seconds and deletes the temp dir. Polling with `kill -0` (rather than waiting for EOF on a
# pipe) keeps it independent of which thread started the server and of fds inherited by forks.
_WATCHDOG_SH = r"""
owner=$1 server=$2 sig=$3 dir=$4
while kill -0 "$owner" 2>/dev/null; do
    kill -0 "$server" 2>/dev/null || exit 0
    sleep 1
done
kill -s "$sig" "$server" 2>/dev/null
n=0
while kill -0 "$server" 2>/dev/null && [ "$n" -lt 100 ]; do sleep 0.1; n=$((n + 1)); done
kill -s KILL "$server" 2>/dev/null
rm -rf "$dir"
"""

# Servers started by this process and not yet stopped; stopped at interpreter exit.
_LIVE: set[_ManagedServer] = set()


@atexit.register
def _stop_all_at_exit() -> None:
    for server in list(_LIVE):
        # A forked child that exits normally runs atexit too; it must not stop our servers.
        if server._owner_pid != os.getpid():
            continue
        with contextlib.suppress(Exception):
            server.stop()


def _pids_alive(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            return True
        return True
    return False


def _child_pids(parent: int) -> list[int]:
    """Direct children of ``parent``, read from /proc (Linux only, like the rest of this)."""
    children = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            data = Path(stat).read_text()
        except OSError:
            continue
        # The command name (2nd field) is in parentheses and may contain spaces.
        fields = data[data.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == parent:
            children.append(int(stat.split("/")[2]))
    return children


class _ManagedServer:
    """Shared process plumbing: temp dir, log file, spawn, watchdog, stop, context manager."""

    #: Prefix of the temp dir, e.g. ``ductor-pg-``.
    _kind = "server"
    #: Signal for a graceful-but-quick shutdown.
    _stop_signal = signal.SIGTERM
    #: Signal the watchdog sends when the owning process has died.
    _orphan_signal = "TERM"

    def __init__(
        self,
        *,
        port: int | None = None,
        base_dir: Path | str | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        self.port: int | None = port
        self.base_dir = Path(base_dir) if base_dir is not None else default_base_dir()
        self.start_timeout = start_timeout
        self._port_fixed = port is not None
        self._tmpdir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._owner_pid = os.getpid()

    # -- public API ----------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def tmpdir(self) -> Path:
        """The server's private temp dir (data, socket, log)."""
        if self._tmpdir is None:
            raise ServerError(f"{self._kind} server has not been started")
        return self._tmpdir

    @property
    def log_path(self) -> Path:
        """The server's log file; kept across restarts (appended to)."""
        return self.tmpdir / f"{self._kind}.log"

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log, for error messages."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                text = f.read().decode("utf-8", "replace")
        except (OSError, ServerError):
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def start(self) -> None:
        """Start the server and wait until it accepts connections.

        Idempotent while running. On the first start of a server whose port was chosen
        automatically, a lost race for the port is retried with a new one.
        """
        if self.running:
            return
        first_start = self._tmpdir is None
        if first_start:
            self._tmpdir = self._make_tmpdir()
            self._prepare()
        attempts = 3 if first_start and not self._port_fixed else 1
        for attempt in range(attempts):
            if self.port is None or (attempt > 0):
                self.port = free_port()
            try:
                self._launch()
                self._wait_ready()
            except ServerError as exc:
                self.kill()
                if attempt + 1 < attempts and "Address already in use" in str(exc):
                    continue
                if first_start:
                    self._cleanup()
                raise
            break
        _LIVE.add(self)

    def stop(self) -> None:
        """Stop the server (fast shutdown) and delete its temp dir. Idempotent."""
        try:
            self._shutdown(self._stop_signal, timeout=30)
        finally:
            self._cleanup()

    def restart(self) -> None:
        """Stop and start again on the same port with the same data dir, so URLs stay valid."""
        if self._tmpdir is None:
            raise ServerError(f"{self._kind} server has never been started")
        self._shutdown(self._stop_signal, timeout=30)
        self.start()

    def kill(self) -> None:
        """SIGKILL the server (a crash). ``start()``/``restart()`` brings it back afterwards."""
        if self._proc is None:
            return
        self._stop_watchdog()
        victims = [self._proc.pid, *_child_pids(self._proc.pid)]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._proc.wait()
        self._proc = None
        # The children are not ours to wait() for; wait until they are gone so that a following
        # start() does not find them still holding the old port or shared memory.
        deadline = time.monotonic() + 10
        while _pids_alive(victims[1:]) and time.monotonic() < deadline:
            time.sleep(0.02)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<{type(self).__name__} {LOOPBACK}:{self.port} {state}>"

    # -- hooks for subclasses -----------------------------------------------------------

    def _prepare(self) -> None:
        """One-time setup of a fresh temp dir (e.g. initdb)."""

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _spawn_kwargs(self) -> dict[str, Any]:
        return {}

    def _probe(self) -> bool:
        """Return True once the server answers; False (or raise) while it does not yet."""
        raise NotImplementedError

    # -- plumbing ------------------------------------------------------------------------

    def _make_tmpdir(self) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"ductor-{self._kind}-", dir=self.base_dir))

    def _launch(self) -> None:
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.tmpdir,
                start_new_session=True,
                **self._spawn_kwargs(),
            )
        self._watchdog = subprocess.Popen(
            [
                "sh",
                "-c",
                _WATCHDOG_SH,
                f"ductor-{self._kind}-watchdog",
                str(os.getpid()),
                str(self._proc.pid),
                self._orphan_signal,
                str(self.tmpdir),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self._proc.poll() is not None:
                raise ServerError(
                    f"{self._kind} server exited with code {self._proc.returncode} during "
                    f"start on {LOOPBACK}:{self.port}; log tail:\n{self.log_tail()}"
                )
            with contextlib.suppress(Exception):
                if self._probe():
                    return
            if time.monotonic() > deadline:
                raise ServerError(
                    f"{self._kind} server on {LOOPBACK}:{self.port} did not become ready within "
                    f"{self.start_timeout:.0f}s; log tail:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _stop_watchdog(self) -> None:
        # Stop the watchdog before the server so it can never act on a recycled pid.
        if self._watchdog is not None:
            # It leads its own process group; killing the group takes its `sleep` along.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._watchdog.pid, signal.SIGKILL)
            self._watchdog.wait()
            self._watchdog = None

    def _shutdown(self, sig: signal.Signals, timeout: float) -> None:
        """Signal the server and wait; escalate to SIGKILL (server and children) on timeout."""
        self._stop_watchdog()
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._proc = None

    def _cleanup(self) -> None:
        _LIVE.discard(self)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        if not self._port_fixed:
            self.port = None


# --------------------------------------------------------------------------------------------
# PostgreSQL
# --------------------------------------------------------------------------------------------


def find_pg_bindir() -> Path:
    """Locate the PostgreSQL server binaries (the directory holding ``initdb``).

    Order: ``$DUCTOR_TEST_PG_BINDIR``, ``pg_config --bindir``, the newest
    ``/usr/lib/postgresql/*/bin`` (Debian keeps server binaries off PATH), then PATH.
    """
    candidates: list[Path] = []
    if env := os.environ.get("DUCTOR_TEST_PG_BINDIR"):
        candidates.append(Path(env))
    if shutil.which("pg_config"):
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            out = subprocess.run(
                ["pg_config", "--bindir"], capture_output=True, text=True, check=True
            ).stdout
            candidates.append(Path(out.strip()))
    versions = glob.glob("/usr/lib/postgresql/*/bin")
    versions.sort(key=lambda p: int(p.split("/")[-2]) if p.split("/")[-2].isdigit() else 0)
    candidates.extend(Path(p) for p in reversed(versions))
    if initdb := shutil.which("initdb"):
        candidates.append(Path(initdb).parent)
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "postgres").is_file():
            return bindir
    raise ServerError(
        "PostgreSQL server binaries (initdb, postgres) not found; install the `postgresql` "
        "package (scripts/test does) or set DUCTOR_TEST_PG_BINDIR"
    )


# --- the `postgres` OS user: PostgreSQL (and our PgBouncer) refuse to run as root -------------


def _postgres_os_user(what: str) -> pwd.struct_passwd | None:
    """The `postgres` OS user to run ``what`` as when we are root; ``None`` otherwise."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        raise ServerError(
            f"running as root but there is no `postgres` OS user to run {what} as"
        ) from None


def _owned_by(tmp: Path, user: pwd.struct_passwd | None) -> Path:
    """mkdtemp makes it 0700 root; the postgres user needs to own it (data dir, socket)."""
    if user is not None:
        os.chown(tmp, user.pw_uid, user.pw_gid)
    return tmp


def _spawn_as(user: pwd.struct_passwd | None) -> dict[str, Any]:
    """Popen arguments: C locale (deterministic, always available, English log messages we
    can match), and the postgres user without root's supplementary groups when we are root."""
    env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
    if user is None:
        return {"env": env}
    env.update(HOME=user.pw_dir, USER="postgres", LOGNAME="postgres")
    return {"env": env, "user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


class PostgresServer(_ManagedServer):
    """A private PostgreSQL cluster on 127.0.0.1, tuned for speed, with trust auth.

    The superuser is ``postgres`` (no password; trust is fine on a loopback-only server).
    Durability is switched off (``fsync``, ``synchronous_commit``, ``full_page_writes``): a
    crash of the test server may lose the cluster, which is irrelevant for tests, and it makes
    commits and CREATE DATABASE much cheaper. ``restart()`` and ``kill()`` still behave like a
    real server as far as clients can tell (connections drop, committed data survives a clean
    restart, crash recovery runs after ``kill()``).

    Example::

        with PostgresServer() as pg:
            pg.create_database("t1")
            engine = sqlalchemy.create_engine(pg.url("t1"))
    """

    _kind = "pg"
    _stop_signal = signal.SIGINT  # "fast" shutdown: roll back and disconnect clients.
    _orphan_signal = "QUIT"  # "immediate" shutdown; the postmaster takes its children along.

    #: Settings passed as ``-c name=value``; extra ``settings`` override these.
    DEFAULT_SETTINGS: Mapping[str, str] = {
        # fsync/full_page_writes only protect against an OS crash, which tests never survive
        # anyway. synchronous_commit stays ON on purpose: with fsync off it costs nothing
        # measurable (a write() into the page cache), while "off" makes kill() lose commits the
        # client already saw succeed (measured: ~50 of 200 rows per kill), which would turn
        # crash tests into false alarms about the engine.
        "fsync": "off",
        "synchronous_commit": "on",
        "full_page_writes": "off",
        "max_connections": "500",
        "shared_buffers": "128MB",
        # The data dir is usually on tmpfs (RAM); keep WAL from growing towards the 1GB default.
        "max_wal_size": "256MB",
        # Parallel query needs dynamic shared memory in /dev/shm, which is tiny in some CI
        # containers; tests gain nothing from it on two cores.
        "max_parallel_workers_per_gather": "0",
    }

    def __init__(
        self,
        *,
        port: int | None = None,
        settings: Mapping[str, str] | None = None,
        bindir: Path | str | None = None,
        base_dir: Path | str | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        super().__init__(port=port, base_dir=base_dir, start_timeout=start_timeout)
        self.settings = {**self.DEFAULT_SETTINGS, **(settings or {})}
        self.bindir = Path(bindir) if bindir is not None else find_pg_bindir()
        # PostgreSQL refuses to run as root; then we run it as the `postgres` OS user.
        self._os_user = _postgres_os_user("PostgreSQL")

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory (inside ``tmpdir``)."""
        return self.tmpdir / "data"

    def url(self, dbname: str = "postgres") -> str:
        """SQLAlchemy URL (psycopg 3 driver) for ``dbname`` as the superuser."""
        return f"postgresql+psycopg://postgres@{LOOPBACK}:{self._require_port()}/{dbname}"

    def conninfo(self, dbname: str = "postgres") -> str:
        """libpq connection string, for ``psycopg.connect`` without SQLAlchemy."""
        return (
            f"host={LOOPBACK} port={self._require_port()} user=postgres dbname={dbname} "
            "connect_timeout=5"
        )

    def connect(self, dbname: str = "postgres") -> psycopg.Connection[tuple[Any, ...]]:
        """An autocommit psycopg connection, for admin statements (caller closes it)."""
        return psycopg.connect(self.conninfo(dbname), autocommit=True)

    def create_database(self, name: str, template: str | None = None) -> None:
        """CREATE DATABASE ``name``, optionally as a copy of ``template``.

        Copying a migrated template is much faster than migrating every test database. PG
        refuses to copy a database that has other sessions, so any connections to the template
        (e.g. a pool left open by whoever migrated it) are terminated first; CREATE DATABASE
        then waits (up to 5 s) for them to go away.
        """
        stmt = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template is not None:
            stmt = sql.SQL("{} TEMPLATE {}").format(stmt, sql.Identifier(template))
        with self.connect() as conn:
            if conn.info.server_version >= 150000:
                # PG 15's default (WAL_LOG) writes the whole copy to WAL; a file copy is about
                # twice as fast for small test databases.
                stmt = sql.SQL("{} STRATEGY FILE_COPY").format(stmt)
            if template is not None:
                self._terminate_backends(conn, template)
            conn.execute(stmt)

    def drop_database(self, name: str) -> None:
        """DROP DATABASE ``name`` if it exists, disconnecting its sessions first."""
        with self.connect() as conn:
            self._terminate_backends(conn, name)
            # WITH (FORCE) also catches sessions that connect between the two statements.
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    # -- internals -----------------------------------------------------------------------

    @staticmethod
    def _terminate_backends(conn: psycopg.Connection[tuple[Any, ...]], dbname: str) -> None:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (dbname,),
        )

    def _require_port(self) -> int:
        if self.port is None:
            raise ServerError("PostgreSQL server has not been started")
        return self.port

    def _make_tmpdir(self) -> Path:
        return _owned_by(super()._make_tmpdir(), self._os_user)

    def _spawn_kwargs(self) -> dict[str, Any]:
        return _spawn_as(self._os_user)

    def _prepare(self) -> None:
        cmd = [
            str(self.bindir / "initdb"),
            "-D",
            str(self.data_dir),
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        ]
        result = subprocess.run(
            cmd,
            cwd=self.tmpdir,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            **self._spawn_kwargs(),
        )
        if result.returncode != 0:
            raise ServerError(
                f"initdb failed with code {result.returncode}:\n{result.stdout}\n{result.stderr}"
            )

    def _command(self) -> list[str]:
        settings = {
            **self.settings,
            "listen_addresses": LOOPBACK,
            "unix_socket_directories": str(self.tmpdir),
        }
        cmd = [str(self.bindir / "postgres"), "-D", str(self.data_dir), "-p", str(self.port)]
        for name, value in settings.items():
            cmd += ["-c", f"{name}={value}"]
        return cmd

    def _probe(self) -> bool:
        with psycopg.connect(
            host=LOOPBACK, port=self.port, user="postgres", dbname="postgres", connect_timeout=2
        ) as conn:
            conn.execute("SELECT 1")
        return True


# --------------------------------------------------------------------------------------------
# A streaming standby, for failover tests (tests/e2e/test_failover_e2e.py)
# --------------------------------------------------------------------------------------------


class StandbyServer(PostgresServer):
    """A hot standby of ``primary``, made by ``pg_basebackup -R`` and streaming from it;
    ``promote()`` makes it the primary (``pg_ctl promote``), as a failover does.

    ``sync=True``: the primary then waits for this standby before it acknowledges a commit
    (``synchronous_standby_names = '*'``, ``synchronous_commit`` is already ``on``), so a
    commit a client saw succeed survives the primary's loss. It is set on the primary by
    ``ALTER SYSTEM`` *after* the base backup: a copy of the setting would make the promoted
    standby wait for a standby of its own on every commit, forever. Without ``sync``, the
    primary acknowledges commits before the standby has them (asynchronous replication).

    The standby's data dir is a copy of the primary's; its settings are the primary's. Its
    ``url()`` reads only until it is promoted; writes fail as read-only.

    Example::

        with PostgresServer() as primary, StandbyServer(primary, sync=True) as standby:
            primary.kill()
            standby.promote()
    """

    _kind = "pg-standby"

    def __init__(
        self,
        primary: PostgresServer,
        *,
        sync: bool = False,
        port: int | None = None,
        base_dir: Path | str | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        super().__init__(
            port=port,
            settings=primary.settings,
            bindir=primary.bindir,
            base_dir=base_dir or primary.base_dir,
            start_timeout=start_timeout,
        )
        self.primary = primary
        self.sync = sync
        self._paused: list[int] = []

    def start(self) -> None:
        """Take the base backup (first start), start streaming, and wait until the primary
        sees this standby streaming (and, with ``sync``, as its synchronous standby)."""
        if self.primary.port is None or not self.primary.running:
            raise ServerError("the primary must be running before its standby starts")
        first_start = self._tmpdir is None
        super().start()
        if first_start:
            self._wait_streaming()

    def promote(self, timeout: float = 60.0) -> None:
        """``pg_ctl promote``, waiting until the server accepts writes."""
        result = subprocess.run(
            [
                str(self.bindir / "pg_ctl"), "promote", "-D", str(self.data_dir),
                "-w", "-t", str(int(timeout)),
            ],
            cwd=self.tmpdir,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            **self._spawn_kwargs(),
        )  # fmt: skip
        if result.returncode != 0:
            raise ServerError(
                f"pg_ctl promote failed ({result.returncode}): {result.stdout}{result.stderr}\n"
                f"log tail:\n{self.log_tail()}"
            )
        deadline = time.monotonic() + timeout
        while True:
            with self.connect() as conn:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
            if row is not None and not row[0]:
                return
            if time.monotonic() > deadline:
                raise ServerError(f"standby on port {self.port} still in recovery after promote")
            time.sleep(0.05)

    def wait_caught_up(self, timeout: float = 30.0) -> None:
        """Wait until this standby has replayed everything the primary has written so far."""
        with self.primary.connect() as conn:
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        target = row[0]
        deadline = time.monotonic() + timeout
        with self.connect() as conn:
            while True:
                done = conn.execute(
                    "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,)
                ).fetchone()
                if done is not None and done[0]:
                    return
                if time.monotonic() > deadline:
                    raise ServerError(f"standby did not replay up to {target} in {timeout:.0f}s")
                time.sleep(0.02)

    def pause_streaming(self) -> list[int]:
        """SIGSTOP the primary's WAL senders: from now on the primary's commits do not reach
        this standby (asynchronous: they are acknowledged anyway, and lost if the primary dies
        now; synchronous: they wait). ``resume_streaming()`` undoes it; a killed primary takes
        its stopped senders along."""
        with self.primary.connect() as conn:
            pids = [row[0] for row in conn.execute("SELECT pid FROM pg_stat_replication")]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        self._paused.extend(pids)
        return pids

    def resume_streaming(self) -> None:
        for pid in self._paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._paused.clear()

    # -- internals -----------------------------------------------------------------------

    def _prepare(self) -> None:
        # No initdb: a copy of the primary, with standby.signal and primary_conninfo (-R).
        cmd = [
            str(self.bindir / "pg_basebackup"),
            "-h", LOOPBACK, "-p", str(self.primary.port), "-U", "postgres",
            "-D", str(self.data_dir), "-R", "-X", "stream", "-c", "fast", "--no-sync",
        ]  # fmt: skip
        result = subprocess.run(
            cmd,
            cwd=self.tmpdir,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            **self._spawn_kwargs(),
        )
        if result.returncode != 0:
            raise ServerError(
                f"pg_basebackup failed with code {result.returncode}:\n"
                f"{result.stdout}\n{result.stderr}"
            )

    def _wait_streaming(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        with self.primary.connect() as conn:
            if self.sync:
                conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
                conn.execute("SELECT pg_reload_conf()")
            want = "sync" if self.sync else "async"
            while True:
                states = [
                    row[0]
                    for row in conn.execute(
                        "SELECT sync_state FROM pg_stat_replication WHERE state = 'streaming'"
                    )
                ]
                if want in states:
                    return
                if time.monotonic() > deadline:
                    raise ServerError(
                        f"standby on port {self.port} not streaming ({want}) within "
                        f"{self.start_timeout:.0f}s; replication: {states}; log tail:\n"
                        f"{self.log_tail()}"
                    )
                time.sleep(0.05)


# --------------------------------------------------------------------------------------------
# Redis
# --------------------------------------------------------------------------------------------


class RedisServer(_ManagedServer):
    """A private, non-persistent redis-server on 127.0.0.1 (the Celery broker in tests).

    No RDB snapshots and no AOF, so ``restart()`` comes back empty: that is what losing the
    broker looks like, and what the engine must survive.
    """

    _kind = "redis"
    _stop_signal = signal.SIGTERM
    _orphan_signal = "TERM"

    def __init__(
        self,
        *,
        port: int | None = None,
        executable: str | None = None,
        extra_args: list[str] | None = None,
        base_dir: Path | str | None = None,
        start_timeout: float = 30.0,
    ) -> None:
        super().__init__(port=port, base_dir=base_dir, start_timeout=start_timeout)
        exe = executable or shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(exe).is_file():
            raise ServerError("redis-server not found; install the `redis-server` package")
        self.executable = exe
        self.extra_args = list(extra_args or [])

    def url(self, db: int = 0) -> str:
        """``redis://127.0.0.1:PORT/DB``, for Celery's broker URL or ``Redis.from_url``."""
        if self.port is None:
            raise ServerError("Redis server has not been started")
        return f"redis://{LOOPBACK}:{self.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        """A ``redis.Redis`` client for ``db`` (caller closes it)."""
        return redis.Redis.from_url(self.url(db))

    def _command(self) -> list[str]:
        return [
            self.executable,
            "--port", str(self.port),
            "--bind", LOOPBACK,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.tmpdir),
            "--daemonize", "no",
            *self.extra_args,
        ]  # fmt: skip

    def _probe(self) -> bool:
        assert self.port is not None
        client = redis.Redis(host=LOOPBACK, port=self.port, socket_connect_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()


# --------------------------------------------------------------------------------------------
# PgBouncer
# --------------------------------------------------------------------------------------------


def find_pgbouncer() -> str:
    """The ``pgbouncer`` binary: on PATH, else where Debian puts it (/usr/sbin, off a user's
    PATH)."""
    exe = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not Path(exe).is_file():
        raise ServerError(
            "pgbouncer not found; install the `pgbouncer` package (scripts/test does)"
        )
    return exe


class PgBouncer(_ManagedServer):
    """A private PgBouncer on 127.0.0.1 in front of ``postgres``, every database passed
    through, trust auth (the user list holds ``postgres`` alone).

    ``pool_mode`` is transaction pooling unless told otherwise: a server connection serves a
    client for one transaction, then the next client's; with ``pool_size`` smaller than the
    clients' pools, consecutive transactions of one client land on different server
    connections, which is what breaks anything that relies on session state.
    """

    _kind = "pgbouncer"
    _stop_signal = signal.SIGTERM  # immediate shutdown (SIGINT would wait for clients)
    _orphan_signal = "TERM"

    def __init__(
        self,
        postgres: PostgresServer,
        *,
        pool_mode: str = "transaction",
        pool_size: int = 2,
        port: int | None = None,
        base_dir: Path | str | None = None,
        start_timeout: float = 30.0,
    ) -> None:
        super().__init__(port=port, base_dir=base_dir, start_timeout=start_timeout)
        self.postgres = postgres
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.executable = find_pgbouncer()
        self._os_user = _postgres_os_user("PgBouncer")

    def url(self, dbname: str = "postgres") -> str:
        """SQLAlchemy URL (psycopg 3 driver) for ``dbname`` through the pooler."""
        if self.port is None:
            raise ServerError("PgBouncer has not been started")
        return f"postgresql+psycopg://postgres@{LOOPBACK}:{self.port}/{dbname}"

    def log_text(self) -> str:
        """The whole log (its warnings are what the tests look at)."""
        return self.log_path.read_text(errors="replace")

    def _make_tmpdir(self) -> Path:
        return _owned_by(super()._make_tmpdir(), self._os_user)

    def _spawn_kwargs(self) -> dict[str, Any]:
        return _spawn_as(self._os_user)

    def _command(self) -> list[str]:
        # Written on every start: the port may have changed after a lost race for it.
        ini = self.tmpdir / "pgbouncer.ini"
        users = self.tmpdir / "userlist.txt"
        users.write_text('"postgres" ""\n')
        ini.write_text(
            "[databases]\n"
            f"* = host={LOOPBACK} port={self.postgres.port}\n"
            "[pgbouncer]\n"
            f"listen_addr = {LOOPBACK}\n"
            f"listen_port = {self.port}\n"
            f"unix_socket_dir = {self.tmpdir}\n"
            "auth_type = trust\n"
            f"auth_file = {users}\n"
            f"pool_mode = {self.pool_mode}\n"
            f"default_pool_size = {self.pool_size}\n"
            "max_client_conn = 2000\n"
            "max_db_connections = 0\n"
            "log_connections = 0\n"
            "log_disconnections = 0\n"
            "admin_users = postgres\n"
        )
        if self._os_user is not None:
            for path in (ini, users):
                os.chown(path, self._os_user.pw_uid, self._os_user.pw_gid)
        return [self.executable, str(ini)]

    def _probe(self) -> bool:
        with psycopg.connect(
            host=LOOPBACK, port=self.port, user="postgres", dbname="postgres", connect_timeout=2
        ) as conn:
            conn.execute("SELECT 1")
        return True


# --------------------------------------------------------------------------------------------
# RabbitMQ
# --------------------------------------------------------------------------------------------

import itertools  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402
import urllib.parse  # noqa: E402

import amqp  # noqa: E402


def find_rabbitmq_bindir() -> Path:
    """Where Debian's ``rabbitmq-server`` package keeps the scripts that run a node without
    switching to the ``rabbitmq`` user (/usr/sbin's wrappers do): ``$DUCTOR_TEST_RABBITMQ_BINDIR``,
    else /usr/lib/rabbitmq/bin."""
    bindir = Path(os.environ.get("DUCTOR_TEST_RABBITMQ_BINDIR") or "/usr/lib/rabbitmq/bin")
    if not (bindir / "rabbitmq-server").is_file() or not shutil.which("epmd"):
        raise ServerError(
            f"rabbitmq-server not found in {bindir} (or no epmd on PATH); install the "
            "`rabbitmq-server` package (scripts/test does) or set DUCTOR_TEST_RABBITMQ_BINDIR"
        )
    return bindir


class RabbitMQServer(_ManagedServer):
    """A private RabbitMQ node on 127.0.0.1, no plugins, user ``guest`` (password ``guest``).

    Everything the node and ``rabbitmqctl`` would take from the machine is in the temp dir or
    on a free loopback port: the node name (unique), mnesia (queues, definitions, quorum logs),
    the config, the enabled-plugins file (none), HOME (the Erlang cookie), and a private
    ``epmd`` on its own port bound to 127.0.0.1; the Erlang distribution listener (which
    ``rabbitmqctl`` talks to) is bound to 127.0.0.1 too, and no epmd is ever started by Erlang
    itself (``-start_epmd false``: an epmd it started would outlive the node).

    ``restart()`` is a clean stop and start and ``kill()`` a SIGKILL of the node: both keep
    mnesia, so durable queues and their persistent messages survive either (quorum queues
    confirm a message only once it is on disk). One exception seen with RabbitMQ 3.10: a quorum
    queue declared a moment (~0.1 s) before a kill can come back without its Raft member, and
    consuming from it then times out (INTERNAL_ERROR after 60 s); declared a few seconds
    before, or followed by a clean restart, it recovers. ``stop()`` leaves no Erlang process
    behind.

    Isolation: each test cluster gets a virtual host of its own (``new_vhost``), so queues,
    Celery's control and event exchanges and every message stay apart; vhosts are made in
    batches (one ``rabbitmqctl import_definitions`` call, ~0.5 s, per 16), because every
    ``rabbitmqctl`` call starts an Erlang VM.
    """

    _kind = "rabbitmq"
    _stop_signal = signal.SIGTERM  # the start script forwards it: a clean node shutdown
    _orphan_signal = "TERM"
    #: Vhosts made at a time by ``new_vhost``.
    VHOST_BATCH = 16

    def __init__(
        self,
        *,
        port: int | None = None,
        bindir: Path | str | None = None,
        base_dir: Path | str | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        super().__init__(port=port, base_dir=base_dir, start_timeout=start_timeout)
        self.bindir = Path(bindir) if bindir is not None else find_rabbitmq_bindir()
        self.node = f"ductor_{os.getpid()}_{os.urandom(4).hex()}@localhost"
        self._epmd: subprocess.Popen[bytes] | None = None
        self._epmd_watchdog: subprocess.Popen[bytes] | None = None
        self._epmd_port: int | None = None
        self._vhosts: list[str] = []
        self._vhost_serial = itertools.count(1)
        self._ctl_lock = threading.Lock()

    # -- public API ----------------------------------------------------------------------

    def url(self, vhost: str = "/") -> str:
        """``amqp://guest:guest@127.0.0.1:PORT/VHOST`` (the vhost URL-quoted: ``/`` is %2F)."""
        if self.port is None:
            raise ServerError("RabbitMQ has not been started")
        return f"amqp://guest:guest@{LOOPBACK}:{self.port}/{urllib.parse.quote(vhost, safe='')}"

    def new_vhost(self) -> str:
        """A virtual host no one has used yet, with all permissions for ``guest``."""
        with self._ctl_lock:
            if not self._vhosts:
                self._make_vhosts(self.VHOST_BATCH)
            return self._vhosts.pop(0)

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """Run ``rabbitmqctl ARGS`` against this node; its stdout. ServerError on failure."""
        result = subprocess.run(
            [str(self.bindir / "rabbitmqctl"), "-n", self.node, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            env=self._env(ctl_port=free_port()),
        )
        if result.returncode != 0:
            raise ServerError(
                f"rabbitmqctl {' '.join(args)} failed with code {result.returncode}:\n"
                f"{result.stdout}\n{result.stderr}"
            )
        return result.stdout

    def queues(self, vhost: str) -> dict[str, dict[str, Any]]:
        """Every queue of ``vhost`` as the node sees it: name -> {type, arguments, messages}."""
        out = self.ctl(
            "list_queues", "-p", vhost, "--formatter", "json", "-q",
            "name", "type", "arguments", "messages",
        )  # fmt: skip
        return {q["name"]: q for q in json.loads(out or "[]")}

    # -- internals -----------------------------------------------------------------------

    def _env(self, ctl_port: int | None = None) -> dict[str, str]:
        tmp = self.tmpdir
        loopback_dist = "-start_epmd false -kernel inet_dist_use_interface {127,0,0,1}"
        env = {
            **os.environ,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "HOME": str(tmp / "home"),  # the Erlang cookie, for the node and rabbitmqctl
            "RABBITMQ_CONF_ENV_FILE": str(tmp / "rabbitmq-env.conf"),  # not /etc/rabbitmq's
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_CONFIG_FILE": str(tmp / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(tmp / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(tmp / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(tmp / "mnesia"),
            "RABBITMQ_LOG_BASE": str(tmp / "log"),
            "RABBITMQ_LOGS": "-",
            "RABBITMQ_PID_FILE": str(tmp / "rabbitmq.pid"),
            "ERL_EPMD_PORT": str(self._epmd_port),
            "ERL_EPMD_ADDRESS": LOOPBACK,
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": loopback_dist,
            "RABBITMQ_CTL_ERL_ARGS": loopback_dist,
        }
        if ctl_port is not None:
            env["RABBITMQ_CTL_DIST_PORT_MIN"] = env["RABBITMQ_CTL_DIST_PORT_MAX"] = str(ctl_port)
        return env

    def _prepare(self) -> None:
        tmp = self.tmpdir
        for sub in ("home", "mnesia", "log"):
            (tmp / sub).mkdir()
        (tmp / "enabled_plugins").write_text("[].\n")
        (tmp / "rabbitmq-env.conf").write_text("")
        self._start_epmd()

    def _start_epmd(self) -> None:
        """A private epmd in the foreground (so it is ours to stop), on a free port, loopback."""
        self._epmd_port = free_port()
        with open(self.tmpdir / "epmd.log", "ab") as log:
            self._epmd = subprocess.Popen(
                ["epmd", "-port", str(self._epmd_port), "-address", LOOPBACK],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._epmd_watchdog = subprocess.Popen(
            [
                "sh", "-c", _WATCHDOG_SH, "ductor-epmd-watchdog",
                str(os.getpid()), str(self._epmd.pid), "TERM", str(self.tmpdir),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            with (
                contextlib.suppress(OSError),
                socket.create_connection((LOOPBACK, self._epmd_port), timeout=0.5),
            ):
                return
            if self._epmd.poll() is not None or time.monotonic() > deadline:
                raise ServerError(
                    f"epmd on {LOOPBACK}:{self._epmd_port} did not start: "
                    f"{(self.tmpdir / 'epmd.log').read_text(errors='replace')}"
                )
            time.sleep(0.02)

    def _stop_epmd(self) -> None:
        if self._epmd_watchdog is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._epmd_watchdog.pid, signal.SIGKILL)
            self._epmd_watchdog.wait()
            self._epmd_watchdog = None
        if self._epmd is not None:
            with contextlib.suppress(ProcessLookupError):
                self._epmd.kill()
            self._epmd.wait()
            self._epmd = None

    def _command(self) -> list[str]:
        # Written on every start: the port may have changed after a lost race for it. The
        # distribution port is new each start too (nothing keeps it).
        (self.tmpdir / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = {LOOPBACK}:{self.port}\n"
            f"distribution.listener.interface = {LOOPBACK}\n"
            "log.console = true\n"
            "log.console.level = info\n"
            "log.file = false\n"
        )
        return [str(self.bindir / "rabbitmq-server")]

    def _spawn_kwargs(self) -> dict[str, Any]:
        env = self._env()
        env["RABBITMQ_DIST_PORT"] = str(free_port())
        return {"env": env}

    def _probe(self) -> bool:
        conn = amqp.Connection(f"{LOOPBACK}:{self.port}", connect_timeout=1)
        try:
            conn.connect()
        finally:
            with contextlib.suppress(Exception):
                conn.close()
        return True

    def _make_vhosts(self, count: int) -> None:
        names = [f"v{next(self._vhost_serial)}" for _ in range(count)]
        definitions = self.tmpdir / "vhosts.json"
        definitions.write_text(
            json.dumps(
                {
                    "vhosts": [{"name": n} for n in names],
                    "permissions": [
                        {
                            "user": "guest",
                            "vhost": n,
                            "configure": ".*",
                            "write": ".*",
                            "read": ".*",
                        }
                        for n in names
                    ],
                }
            )
        )
        self.ctl("import_definitions", str(definitions))
        # The import runs on after rabbitmqctl returns: wait until the last vhost lets us in.
        deadline = time.monotonic() + 30
        while True:
            conn = amqp.Connection(f"{LOOPBACK}:{self.port}", virtual_host=names[-1])
            try:
                conn.connect()
                break
            except Exception as exc:  # noqa: BLE001 - not there yet
                if time.monotonic() > deadline:
                    raise ServerError(f"vhosts {names} never appeared: {exc}") from exc
                time.sleep(0.05)
            finally:
                with contextlib.suppress(Exception):
                    conn.close()
        self._vhosts.extend(names)

    def _cleanup(self) -> None:
        self._stop_epmd()
        super()._cleanup()
