"""The test servers of ``tests/servers.py``, each on a host of a fleet (chaos/fleet.py).

``tests/servers.py`` starts its servers on 127.0.0.1. Here a mixin, ``InHost``, puts any of
them on a fleet host instead, without changing that file:

* the command the server class builds runs behind ``ip netns exec <host's namespace>`` (which
  execs it: the server's pid stays the pid the class waits for and signals), and every
  ``127.0.0.1`` in it becomes the host's address (``listen_addresses``, ``--bind``);
* a server the class runs as another OS user (PostgreSQL and PgBouncer refuse root) is
  started as root up to ``ip netns exec`` and drops to that user with ``setpriv`` right after
  (``Popen(user=...)`` would drop root before ``ip`` could join the namespace);
* the port is fixed (each host has an address of its own: nothing else listens there), so a
  restart keeps every URL handed out;
* ``url``/``conninfo``/``client`` and the readiness probe use the host's address; they must be
  called from a thread inside the fleet (the harness's driver has entered its host).

A new server kind plugs in the same way: a subclass that mixes ``InHost`` in, and a probe on
the host's address (``FleetRabbitMQ``, ``FleetStandby``). ``make_broker`` is where the broker
kind is chosen; an unknown kind raises ``Unavailable`` with the reason.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

import psycopg
import redis
import servers
from amqp import Connection as _AmqpConnection
from fleet import Fleet
from servers import (
    LOOPBACK,
    PgBouncer,
    PostgresServer,
    RabbitMQServer,
    RedisServer,
    ServerError,
    StandbyServer,
)


class Unavailable(RuntimeError):
    """A server kind (or a fault that needs it) this tree cannot provide yet."""


class InHost:
    """Mixin for a ``tests/servers.py`` server class: run it on ``host`` of ``fleet``."""

    fleet: Fleet
    host: str
    _launching = False

    def _in_host(self, fleet: Fleet, host: str) -> None:
        self.fleet = fleet
        self.host = host

    @property
    def addr(self) -> str:
        return self.fleet.addr(self.host)

    def _launch(self) -> None:
        self._launching = True
        try:
            super()._launch()  # type: ignore[misc]
        finally:
            self._launching = False

    def _spawn_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(super()._spawn_kwargs())  # type: ignore[misc]
        if self._launching:
            # Root until `ip netns exec` has joined the namespace; setpriv drops it (below).
            for key in ("user", "group", "extra_groups"):
                kwargs.pop(key, None)
        return kwargs

    def _command(self) -> list[str]:
        cmd = [arg.replace(LOOPBACK, self.addr) for arg in super()._command()]  # type: ignore[misc]
        runs_as = super()._spawn_kwargs()  # type: ignore[misc]
        prefix = self.fleet.exec_prefix(self.host)
        if runs_as.get("user") is not None:
            prefix += [
                "setpriv",
                f"--reuid={runs_as['user']}",
                f"--regid={runs_as['group']}",
                "--clear-groups",
            ]
        return [*prefix, *cmd]

    def _tcp_probe(self, port: int) -> bool:
        with socket.create_connection((self.addr, port), timeout=1):
            return True


class _FleetPg:
    """What a PostgreSQL server on a fleet host answers to: its host's address, port 5432."""

    addr: str
    port: int | None

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@{self.addr}:{self.port}/{dbname}"

    def conninfo(self, dbname: str = "postgres") -> str:
        return f"host={self.addr} port={self.port} user=postgres dbname={dbname} connect_timeout=5"

    def _probe(self) -> bool:
        with psycopg.connect(
            host=self.addr, port=self.port, user="postgres", dbname="postgres", connect_timeout=2
        ) as conn:
            conn.execute("SELECT 1")
        return True


class FleetPostgres(_FleetPg, InHost, PostgresServer):
    """PostgreSQL on a fleet host, port 5432, trusting the fleet's subnet (as the loopback-only
    test server trusts 127.0.0.1; replication too, for a standby)."""

    def __init__(self, fleet: Fleet, host: str, **kwargs: Any) -> None:
        self._in_host(fleet, host)
        super().__init__(port=5432, **kwargs)

    def _prepare(self) -> None:
        super()._prepare()
        subnet = str(self.fleet.net)
        hba = self.data_dir / "pg_hba.conf"
        with open(hba, "a") as f:
            f.write(f"host all all {subnet} trust\nhost replication all {subnet} trust\n")


class FleetStandby(_FleetPg, InHost, StandbyServer):
    """A streaming standby of ``primary`` (a ``FleetPostgres`` or a promoted ``FleetStandby``)
    on a fleet host, port 5432: ``pg_basebackup -R`` from the primary's address (its
    ``pg_hba.conf``, trusting the subnet, comes along)."""

    def __init__(self, fleet: Fleet, host: str, primary: Any, *, sync: bool) -> None:
        self._in_host(fleet, host)
        super().__init__(primary, sync=sync, port=5432)
        self.promoted = False

    def start(self) -> None:
        if self.promoted:
            # A primary now (a pg_restart of the current primary): ``StandbyServer.start``
            # would insist that the old primary, long gone, be running.
            PostgresServer.start(self)
        else:
            super().start()

    def promote(self, timeout: float = 60.0) -> None:
        super().promote(timeout)
        self.promoted = True

    def _prepare(self) -> None:
        cmd = [
            str(self.bindir / "pg_basebackup"),
            "-h", self.primary.addr, "-p", str(self.primary.port), "-U", "postgres",
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
                f"pg_basebackup from {self.primary.addr} failed ({result.returncode}):\n"
                f"{result.stdout}\n{result.stderr}"
            )


class DbPair:
    """The fleet's database: a primary on ``pg0`` and, with ``standby``, a streaming standby on
    ``pg1``. ``failover()`` swaps them: the primary SIGKILLed, the standby promoted, the old
    primary's data thrown away and its host rebuilt as the new primary's standby (a fresh base
    backup), so the next failover goes back."""

    def __init__(self, fleet: Fleet, *, standby: bool, sync: bool) -> None:
        self.fleet = fleet
        self.sync = sync
        self.primary: Any = FleetPostgres(fleet, "pg0")
        self.standby: Any = None
        self.want_standby = standby
        self.failovers = 0

    def start(self) -> None:
        self.primary.start()
        if self.want_standby:
            self._rebuild("pg1")

    def _rebuild(self, host: str) -> float:
        t = time.monotonic()
        standby = FleetStandby(self.fleet, host, self.primary, sync=self.sync)
        standby.start()
        self.standby = standby
        return time.monotonic() - t

    def hosts(self) -> list[str]:
        return ["pg0", *(["pg1"] if self.want_standby else [])]

    def url(self, dbname: str) -> str:
        """Every host that may be the primary, in libpq's multi-host form (ductor adds
        ``target_session_attrs=read-write``)."""
        hosts = ",".join(f"{self.fleet.addr(h)}:5432" for h in self.hosts())
        return f"postgresql+psycopg://postgres@{hosts}/{dbname}"

    def failover(
        self,
        down_s: float,
        sleep: Callable[[float], None],
        lag_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> dict[str, Any]:
        """``lag_s`` > 0 (asynchronous only): the primary's WAL senders are stopped that long
        before the kill, so the commits it acknowledged in that time never reach the standby
        and are lost (a standby behind by ``lag_s``, as under load or over a slow link).
        ``detail.killed_at``: ``clock()`` right after the kill (the end of the loss window)."""
        if self.standby is None:
            raise Unavailable("no standby to promote")
        old, new = self.primary, self.standby
        detail: dict[str, Any] = {"from": old.host, "to": new.host, "sync": self.sync}
        if lag_s > 0 and not self.sync:
            detail["walsenders_stopped"] = len(new.pause_streaming())
            detail["walsenders_stopped_at"] = round(clock(), 3)
            detail["lag_s"] = lag_s
            sleep(lag_s)
        t = time.monotonic()
        old.kill()
        detail["killed_at"] = round(clock(), 3)
        new._paused.clear()  # noqa: SLF001 - they died with the primary
        sleep(down_s)
        new.promote()
        detail["promoted_after_s"] = round(time.monotonic() - t, 2)
        self.primary, self.standby = new, None
        self.failovers += 1
        old._cleanup()  # noqa: SLF001 - the old primary's data: a fresh base backup replaces it
        detail["rebuilt_in_s"] = round(self._rebuild(old.host), 2)
        return detail

    def ensure_running(self) -> None:
        """After the faults: the primary up, and a standby streaming from it."""
        if not self.primary.running:
            self.primary.start()
        if self.want_standby and (self.standby is None or not self.standby.running):
            if self.standby is not None:
                self.standby.kill()
                self.standby._cleanup()  # noqa: SLF001
            self._rebuild("pg1" if self.primary.host == "pg0" else "pg0")

    def stop(self) -> None:
        for server in (self.standby, self.primary):
            if server is not None:
                try:
                    server.stop()
                except Exception:  # noqa: BLE001 - stop the other one anyway
                    pass


class FleetRedis(InHost, RedisServer):
    """Redis on a fleet host, port 6379, no persistence (a restart loses everything)."""

    kind = "redis"

    def __init__(self, fleet: Fleet, host: str, **kwargs: Any) -> None:
        self._in_host(fleet, host)
        # Protected mode refuses every client but 127.0.0.1 when there is no password; the
        # server listens on the fleet's private address only, inside its namespace.
        extra = ["--protected-mode", "no", *kwargs.pop("extra_args", [])]
        super().__init__(port=6379, extra_args=extra, **kwargs)

    def url(self, db: int = 0) -> str:
        return f"redis://{self.addr}:{self.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis.from_url(self.url(db))

    def _probe(self) -> bool:
        client = redis.Redis(host=self.addr, port=self.port, socket_connect_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()


class FleetPgBouncer(InHost, PgBouncer):
    """PgBouncer on a fleet host, port 6432, in front of ``postgres`` (transaction pooling)."""

    def __init__(self, fleet: Fleet, host: str, postgres: FleetPostgres, **kwargs: Any) -> None:
        self._in_host(fleet, host)
        super().__init__(postgres, port=6432, **kwargs)

    def _command(self) -> list[str]:
        cmd = super()._command()
        # The config file the class wrote names 127.0.0.1 twice: where PostgreSQL is, where to
        # listen.
        ini = self.tmpdir / "pgbouncer.ini"
        pg = self.postgres
        assert isinstance(pg, FleetPostgres)
        text = ini.read_text()
        text = text.replace(f"host={LOOPBACK}", f"host={pg.addr}")
        text = text.replace(f"listen_addr = {LOOPBACK}", f"listen_addr = {self.addr}")
        ini.write_text(text)
        return cmd

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@{self.addr}:{self.port}/{dbname}"

    def _probe(self) -> bool:
        with psycopg.connect(
            host=self.addr, port=self.port, user="postgres", dbname="postgres", connect_timeout=2
        ) as conn:
            conn.execute("SELECT 1")
        return True


class FleetRabbitMQ(InHost, RabbitMQServer):
    """RabbitMQ on a fleet host: AMQP on the host's address, port 5672; everything Erlang
    (the private ``epmd``, the distribution listener ``rabbitmqctl`` talks to) on the loopback
    *inside the host's namespace*, so only that host reaches it and a partition of the host
    never cuts the node from its own epmd. ``guest`` may log in from the fleet's addresses
    (``loopback_users = none``: RabbitMQ lets ``guest`` in from 127.0.0.1 only by default).
    Clients use the default vhost ``/``. ``restart()`` (SIGTERM, start) and ``kill()`` (SIGKILL
    of the start script and the Erlang VM) keep mnesia: durable quorum queues survive both."""

    kind = "rabbitmq"

    def __init__(self, fleet: Fleet, host: str, **kwargs: Any) -> None:
        self._in_host(fleet, host)
        super().__init__(port=5672, **kwargs)

    def url(self, *_: Any) -> str:
        """``amqp://guest:guest@ADDR:5672//`` (the harness asks for ``url(0)``: a Redis db)."""
        return f"amqp://guest:guest@{self.addr}:{self.port}/%2F"

    def _command(self) -> list[str]:
        cmd = super()._command()  # InHost's prefix; RabbitMQServer wrote rabbitmq.conf
        conf = self.tmpdir / "rabbitmq.conf"
        text = conf.read_text().replace(
            f"listeners.tcp.1 = {LOOPBACK}:", f"listeners.tcp.1 = {self.addr}:"
        )
        conf.write_text(text + "loopback_users = none\n")
        return cmd

    def _start_epmd(self) -> None:
        """The private epmd inside the host (loopback there, plus the host's address, which
        only serves the readiness probe from the driver's host)."""
        self._epmd_port = servers.free_port()
        with open(self.tmpdir / "epmd.log", "ab") as log:
            self._epmd = subprocess.Popen(
                [
                    *self.fleet.exec_prefix(self.host),
                    "epmd", "-port", str(self._epmd_port), "-address", f"{LOOPBACK},{self.addr}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self._epmd_watchdog = subprocess.Popen(
            [
                "sh", "-c", servers._WATCHDOG_SH, "ductor-epmd-watchdog",  # noqa: SLF001
                str(os.getpid()), str(self._epmd.pid), "TERM", str(self.tmpdir),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            try:
                if self._tcp_probe(self._epmd_port):
                    return
            except OSError:
                pass
            if self._epmd.poll() is not None or time.monotonic() > deadline:
                raise ServerError(
                    f"epmd on {self.host} port {self._epmd_port} did not start: "
                    f"{(self.tmpdir / 'epmd.log').read_text(errors='replace')}"
                )
            time.sleep(0.02)

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """``rabbitmqctl ARGS`` run on the broker's host (the node is on its loopback)."""
        result = subprocess.run(
            [*self.fleet.exec_prefix(self.host), str(self.bindir / "rabbitmqctl"), "-n",
             self.node, *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            env=self._env(ctl_port=servers.free_port()),
        )  # fmt: skip
        if result.returncode != 0:
            raise ServerError(
                f"rabbitmqctl {' '.join(args)} failed with code {result.returncode}:\n"
                f"{result.stdout}\n{result.stderr}"
            )
        return result.stdout

    def _probe(self) -> bool:
        conn = _AmqpConnection(
            f"{self.addr}:{self.port}", userid="guest", password="guest", connect_timeout=1
        )
        try:
            conn.connect()
        finally:
            try:
                conn.close()
            except Exception:  # noqa: BLE001, S110 - a probe
                pass
        return True


def broker_unavailable(kind: str) -> str | None:
    """Why the broker ``kind`` cannot run on the fleet in this tree (None: it can)."""
    if kind in ("redis", "rabbitmq"):
        return None
    return f"unknown broker kind {kind!r}"


def make_broker(kind: str, fleet: Fleet, host: str) -> Any:
    """The broker server of ``kind`` on ``host`` (not started)."""
    if reason := broker_unavailable(kind):
        raise Unavailable(reason)
    if kind == "redis":
        return FleetRedis(fleet, host)
    return FleetRabbitMQ(fleet, host)


def standby_unavailable(pooler: str = "none") -> str | None:
    """Why the fleet has no streaming standby (so no ``failover`` fault): None when it has."""
    if pooler != "none":
        return (
            "PgBouncer is configured with one PostgreSQL host (pg0); a pooler that follows the "
            "primary is not built yet, so --pooler runs without a standby"
        )
    return None


__all__ = [
    "DbPair",
    "FleetPgBouncer",
    "FleetPostgres",
    "FleetRabbitMQ",
    "FleetRedis",
    "FleetStandby",
    "InHost",
    "Unavailable",
    "broker_unavailable",
    "make_broker",
    "standby_unavailable",
]
