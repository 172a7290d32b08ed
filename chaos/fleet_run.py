"""``scripts/chaos --fleet``: the chaos harness on hosts of their own (docs/fleet.md).

The same workload, nemesis and checker as ``chaos/run.py``, on a fleet of network namespaces
(chaos/fleet.py) on one private bridge:

=========  ================================================================================
host       what runs there (the production commands, from chaos/)
=========  ================================================================================
pg0, pg1   PostgreSQL: a primary and a streaming standby (``--replication sync|async``);
           a failover swaps them (no standby with ``--pooler pgbouncer``)
broker     Redis, or RabbitMQ with ``--broker rabbitmq`` (quorum queues, confirms)
pooler     PgBouncer in transaction pooling mode (``--pooler pgbouncer``)
steps<N>   ``celery -A app worker -Q ductor-steps -c 2``
coord<N>   ``celery -A app worker -Q ductor-coord -c 1``
driver     this process: the workload's client, the nemesis, the checker
=========  ================================================================================

The driver joins its own host before it starts anything, so it reaches the servers over the
bridge like any client; it is never partitioned (it is the observer, like Jepsen's control
node). The ledger is a file per worker process (``CHAOS_LEDGER_DIR``, chaos/ledger.py): a
host cut from the database still records what its steps did, and the driver loads it into
``chaos_ledger`` before the checker runs.

The nemesis gets the fleet's faults (``nemesis.FLEET_KINDS``): ``partition_db``,
``partition_broker``, ``partition_all`` (shorter and longer than the step timeout, both ways
or one way), ``flap``, and ``failover`` when the topology has a standby; with RabbitMQ its
own broker faults (``nemesis.RABBITMQ_KINDS``) replace the ``redis_*`` ones. A kind the
topology cannot inject is not scheduled, and the report's ``faults_not_scheduled`` says why.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ledger
from fleet import Fleet, unavailable_reason
from fleet_servers import (
    DbPair,
    FleetPgBouncer,
    broker_unavailable,
    make_broker,
    standby_unavailable,
)
from nemesis import (
    FLEET_FIRST,
    FLEET_KINDS,
    KINDS,
    PARTITION_LONG,
    PARTITION_ONE_WAY,
    RABBITMQ_KINDS,
    Fault,
    Nemesis,
    make_schedule,
)
from procs import Worker
from run import CHAOS_DIR, DBNAME, ROOT, Harness, say, worker_plan

#: Faults of the single-box harness that name Redis (the broker of a fleet may be another).
REDIS_KINDS = ("redis_restart", "redis_outage")


@dataclass
class Topology:
    """What the fleet is made of; decides which faults it can take."""

    broker: str = "redis"
    pooler: str = "none"
    replication: str = "sync"
    failover_lag: float = 0.0
    workers: dict[str, str] = field(default_factory=dict)  # host -> "steps" | "coord"
    failpoints: list[str] = field(default_factory=list)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Topology:
        plan = worker_plan(args)
        return cls(
            broker=args.broker,
            pooler=args.pooler,
            replication=getattr(args, "replication", "sync"),
            failover_lag=getattr(args, "failover_lag", 0.0),
            workers={name: role for name, role, _, _, _ in plan},
            failpoints=[name for name, _, _, fp, _ in plan if fp],
        )

    @property
    def standby(self) -> bool:
        return standby_unavailable(self.pooler) is None

    def hosts(self) -> list[str]:
        return [
            "pg0",
            *(["pg1"] if self.standby else []),
            "broker",
            *(["pooler"] if self.pooler != "none" else []),
            *self.workers,
            "driver",
        ]

    def groups(self) -> dict[str, list[str]]:
        """What ``partition(host, "db" | "broker")`` cuts a host from."""
        db = ["pg0", *(["pg1"] if self.standby else [])]
        if self.pooler != "none":
            db.append("pooler")
        return {"db": db, "broker": ["broker"]}

    def not_scheduled(self) -> dict[str, str]:
        """Fault kinds this topology cannot inject, and why."""
        out = {}
        if reason := standby_unavailable(self.pooler):
            out["failover"] = reason
        if self.broker != "redis":
            for kind in REDIS_KINDS:
                out[kind] = f"the broker is {self.broker}, not Redis"
        if self.broker != "rabbitmq":
            for kind in RABBITMQ_KINDS:
                out[kind] = f"the broker is {self.broker}, not RabbitMQ"
        return out

    def kinds(self) -> dict[str, tuple[float, str]]:
        skip = self.not_scheduled()
        every = {**KINDS, **FLEET_KINDS, **RABBITMQ_KINDS}
        return {k: v for k, v in every.items() if k not in skip}


def fleet_schedule(args: argparse.Namespace) -> list[Fault]:
    """The fleet's fault schedule for ``args.seed``: a pure function of the arguments and of
    what the topology can take."""
    topo = Topology.from_args(args)
    gap = args.mean_gap or (2.2 if args.minutes < 3 else 4.0)
    return make_schedule(
        args.seed,
        args.minutes * 60.0,
        topo.workers,
        topo.failpoints,
        mean_gap_s=gap,
        step_timeout=args.step_timeout,
        kinds=topo.kinds(),
        first=FLEET_FIRST,
    )


class FleetWorker(Worker):
    """A worker whose command runs on its own host: ``ip netns exec <ns> celery ...``."""

    def __init__(self, fleet: Fleet, *args: Any, **kwargs: Any) -> None:
        self.fleet = fleet
        super().__init__(*args, **kwargs)

    @property
    def command(self) -> list[str]:
        return [*self.fleet.exec_prefix(self.name), *super().command]


class FleetNemesis(Nemesis):
    """The single-box nemesis plus the network's faults."""

    def __init__(
        self, *args: Any, fleet: Fleet, topology: Topology, db: DbPair, **kwargs: Any
    ) -> None:
        self.db = db
        super().__init__(*args, **kwargs)
        self.fleet = fleet
        self.topology = topology

    def _do_partition_db(self, fault: Fault) -> None:
        self._partition(fault, "db")

    def _do_partition_broker(self, fault: Fault) -> None:
        self._partition(fault, "broker")

    def _do_partition_all(self, fault: Fault) -> None:
        self._partition(fault, "all")

    def _partition(self, fault: Fault, what: str) -> None:
        # One way: the peers' packets to the host are lost; its requests still arrive (a
        # COMMIT is applied, its answer never comes back).
        direction = "in" if fault.param & PARTITION_ONE_WAY else "both"
        fault.detail["longer_than_step_timeout"] = bool(fault.param & PARTITION_LONG)
        fault.detail.update(self.fleet.partition(fault.target, what, direction=direction))
        try:
            self._sleep(fault.duration)
        finally:
            self.fleet.heal(fault.target)

    def _do_flap(self, fault: Fault) -> None:
        fault.detail["period_s"] = fault.param / 1000.0
        fault.detail["downs"] = self.fleet.flap(fault.target, fault.param / 1000.0, fault.duration)

    @property  # type: ignore[override]
    def pg(self) -> Any:
        """The current primary (a failover moves it)."""
        return self.db.primary

    @pg.setter
    def pg(self, value: Any) -> None:
        pass  # Nemesis.__init__ hands the first primary; self.db knows the current one

    def _do_failover(self, fault: Fault) -> None:
        # Scheduled only when the topology has a standby (Topology.not_scheduled).
        if self.pg_down:
            fault.result = "skipped: pg down"
            return
        self.pg_down = True
        try:
            # --failover-lag (asynchronous pair, faults whose param is 0): the standby lags
            # that far behind when the primary dies, so that acknowledged commits are lost.
            lag = self.topology.failover_lag if fault.param == 0 else 0.0
            fault.detail.update(
                self.db.failover(fault.duration, self._sleep, lag_s=lag, clock=self.now)
            )
        finally:
            self.pg_down = False

    def _do_rabbitmq_restart(self, fault: Fault) -> None:
        # Scheduled only when the broker is RabbitMQ (Topology.not_scheduled).
        if self.redis_down:
            fault.result = "skipped: broker down"
            return
        self.redis_down = True
        try:
            t = time.monotonic()
            self.redis.restart()
            fault.detail["back_after_s"] = round(time.monotonic() - t, 2)
        finally:
            self.redis_down = False

    def _do_rabbitmq_kill(self, fault: Fault) -> None:
        if self.redis_down:
            fault.result = "skipped: broker down"
            return
        self.redis_down = True
        try:
            self.redis.kill()
            self._sleep(fault.duration)
            t = time.monotonic()
            self.redis.start()
            fault.detail["start_s"] = round(time.monotonic() - t, 2)
        finally:
            self.redis_down = False

    def heal(self, timeout: float = 120.0) -> float:
        last = super().heal(timeout)
        self.fleet.heal()
        self.db.ensure_running()
        return last


class FleetHarness(Harness):
    """``Harness`` on a fleet: servers, workers and the driver each on a host of their own."""

    def __init__(self, args: argparse.Namespace, stack: Any) -> None:
        super().__init__(args, stack)
        if args.step_workers < 2:
            raise SystemExit("--fleet needs at least 2 step-worker hosts")
        self.topology = Topology.from_args(args)
        self.kinds = self.topology.kinds()
        if reason := unavailable_reason():
            raise SystemExit(f"--fleet: {reason}")
        if reason := broker_unavailable(args.broker):
            raise SystemExit(f"--fleet --broker {args.broker}: {reason}")

    def setup(self) -> None:
        t = time.monotonic()
        self.fleet = Fleet()
        self.fleet.install_signal_handlers()
        # Registered first, so it runs last: after the workers and servers have stopped.
        self.stack.callback(self.fleet.teardown)
        self.fleet.create(self.topology.hosts())
        self.fleet.groups.update(self.topology.groups())
        # Everything this process opens from here on goes through the fleet.
        self.fleet.enter("driver")
        say(
            f"fleet {self.fleet.tag}: {len(self.fleet.hosts)} hosts on {self.fleet.net} "
            f"({time.monotonic() - t:.2f}s): "
            + ", ".join(f"{h.name} {h.addr}" for h in self.fleet.hosts.values())
        )
        self.report["hosts"] = self.fleet.namespaces()
        super().setup()

    @property  # type: ignore[override]
    def pg(self) -> Any:
        """The current primary (a failover moves it)."""
        return self.db.primary

    @property  # type: ignore[override]
    def pg_host(self) -> str:
        return str(self.db.primary.addr)

    def start_servers(self) -> None:
        from ductor_celery.settings import multi_host_url

        t = time.monotonic()
        self.db = DbPair(
            self.fleet,
            standby=self.topology.standby,
            sync=self.topology.replication == "sync",
        )
        self.stack.callback(self.db.stop)
        self.db.primary.start()
        self.redis = make_broker(self.args.broker, self.fleet, "broker")
        self.redis.start()
        self.stack.callback(self.redis.stop)
        self.pg.create_database(DBNAME)
        if self.topology.standby:
            self.db.start()  # the base backup, after the database exists
            # Every ductor process names both hosts; libpq finds the one that takes writes.
            self.db_url = self.db.url(DBNAME)
            self.migrate_url = multi_host_url(self.db_url)
        else:
            self.db_url = self.migrate_url = self.pg.url(DBNAME)
        self.pooler: FleetPgBouncer | None = None
        if self.args.pooler == "pgbouncer":
            self.pooler = FleetPgBouncer(self.fleet, "pooler", self.pg, pool_size=20)
            self.pooler.start()
            self.stack.callback(self.pooler.stop)
            self.db_url = self.pooler.url(DBNAME)
        self.broker_url = self.redis.url(0)
        say(
            f"PostgreSQL {self.pg.addr}:{self.pg.port}"
            + (
                f" + {self.topology.replication} standby {self.db.standby.addr}"
                if self.db.standby
                else ""
            )
            + f", {self.args.broker} "
            f"{self.redis.addr}:{self.redis.port}"
            + (f", PgBouncer {self.pooler.addr}:{self.pooler.port}" if self.pooler else "")
            + f" ({time.monotonic() - t:.1f}s)"
        )

    def extra_env(self) -> dict[str, str]:
        ledger_dir = Path(self.workdir) / "ledger"
        ledger_dir.mkdir(exist_ok=True)
        env = {
            "CHAOS_LEDGER_DIR": str(ledger_dir),
            # The tree this harness lives in, whatever package is installed in the venv.
            "PYTHONPATH": os.pathsep.join(
                [str(CHAOS_DIR), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        if self.pooler is not None:
            env["DUCTOR_LISTEN_DATABASE_URL"] = self.migrate_url
            env["DUCTOR_DATABASE_PREPARE"] = "false"
        return env

    def make_worker(self, *args: Any, **kwargs: Any) -> Worker:
        return FleetWorker(self.fleet, *args, **kwargs)

    def make_schedule(self) -> list[Any]:
        return fleet_schedule(self.args)

    def make_nemesis(self, schedule: list[Any]) -> Nemesis:
        from checker import async_loss_windows
        from run import COORD_QUEUE, STEPS_QUEUE

        # The workload stops waiting for a run whose start an asynchronous failover lost.
        self.workload.loss_windows = lambda: async_loss_windows([f.to_json() for f in schedule])
        return FleetNemesis(
            schedule,
            self.workers,
            self.pg,
            self.redis,
            DBNAME,
            self.app.app.send_task,
            STEPS_QUEUE,
            COORD_QUEUE,
            self.args.seed,
            publish=self.publish_raw,
            fleet=self.fleet,
            topology=self.topology,
            db=self.db,
        )

    def before_check(self) -> None:
        n = ledger.load_files(Path(self.workdir) / "ledger", self.pg.conninfo(DBNAME))
        say(f"ledger: {n} executions loaded from the hosts' files")

    def extra_report(self) -> dict[str, Any]:
        return {
            "hosts": self.fleet.namespaces() or self.report.get("hosts", []),
            "fleet": {
                "subnet": str(self.fleet.net),
                "addresses": {h.name: h.addr for h in self.fleet.hosts.values()},
                "broker": self.args.broker,
                "pooler": self.args.pooler,
                "standby": self.topology.standby,
                "replication": self.topology.replication if self.topology.standby else None,
                "failovers": self.db.failovers,
                "primary_at_end": self.db.primary.host,
                "groups": self.fleet.groups,
            },
            "faults_not_scheduled": self.topology.not_scheduled(),
        }


__all__ = ["FleetHarness", "FleetNemesis", "FleetWorker", "Topology", "fleet_schedule"]
