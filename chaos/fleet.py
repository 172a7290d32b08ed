"""Hosts on one machine: network namespaces on a private bridge, and partitions between them.

A ``Fleet`` is a set of Linux network namespaces ("hosts"), each with one veth link to a bridge
that lives in a namespace of its own, and an address from a private /24 (``10.213.7.0/24`` by
default). The machine's own (root) namespace never gets an address, a route or a link of the
fleet: every veth is created directly inside its host's namespace with its peer inside the
bridge's, and the hosts have no default route, so their traffic never leaves the bridge.
docs/fleet.md is the design; ``chaos/fleet_run.py`` builds the chaos harness's fleet on it.

Names: every namespace is ``dct-<tag>-<host>`` (the bridge's: ``dct-<tag>-br``), the tag is
``f<pid of the owner>``; links are ``dct-eth0`` in a host and ``dct-h<N>`` (and the bridge
``dct-br0``) in the bridge's namespace, so nothing of the fleet is ever named outside the
``dct-`` prefix. The owner writes ``/run/dct-fleet/<tag>`` (its pid and start time) before it
creates anything.

Faults, all reversible:

* ``partition(host, "db" | "broker" | <host> | [...], direction)``: the host and those peers
  stop hearing each other. Frames are sent to a MAC address nobody has (a permanent neighbour
  entry replaces the peer's), so packets vanish silently, both for established connections
  and for new ones (a SYN times out): what a real partition looks like. ``direction`` "both",
  "out" (the host's packets to the peers are lost) or "in" (the peers' packets to the host are
  lost: requests arrive and are acted on, answers never come back). ``method="blackhole"`` or
  ``"prohibit"`` use ``ip route add blackhole|prohibit <addr>/32`` in the sending namespace
  instead: the sender's kernel refuses at once (EINVAL, EACCES), an "unreachable" rather than
  a silent partition.
* ``partition(host, "all")``: the host's port on the bridge goes down (a pulled cable).
* ``flap(host, period, duration)``: that port goes down and up every ``period / 2`` seconds.
* ``heal(host=None)``: undoes every cut of the host (of every host).

Clean-up: ``teardown()`` (also at interpreter exit and on SIGTERM/SIGHUP/SIGINT through
``install_signal_handlers``) kills whatever still runs in the fleet's namespaces and deletes
them (deleting the bridge's namespace destroys every veth); a detached watchdog does the same
if the owner dies without cleaning up (SIGKILL); ``sweep()``, run by ``create()``, removes
leftovers of any earlier fleet whose owner is gone.

Running code in a host: ``exec_prefix(host)`` (``ip netns exec <ns>``) before a command;
``call_in(host, fn)`` runs ``fn`` in a fresh thread that has joined the host's namespace
(``setns`` is per thread); ``enter(host)`` moves the calling thread, for good (the harness's
driver enters its own host before it starts any thread, so all it opens goes through the
fleet).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ipaddress
import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("chaos.fleet")

PREFIX = "dct-"
IFACE = "dct-eth0"  # a host's end of its veth
BRIDGE = "dct-br0"  # the bridge, in the bridge's namespace
BRIDGE_HOST = "br"  # the bridge namespace's host name (reserved)
DEFAULT_SUBNET = "10.213.7.0/24"
FIRST_HOST = 10  # hosts get .10, .11, ...
#: A locally administered unicast MAC that no interface of the fleet has: frames sent to it
#: are flooded by the bridge and dropped by every receiving interface (not theirs).
NOWHERE_MAC = "02:00:5e:dc:7f:01"
OWNER_DIR = Path("/run/dct-fleet")
NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
_NAME = re.compile(r"^dct-(?P<tag>f\d+)-(?P<host>[a-z0-9]+)$")

T = TypeVar("T")


class FleetError(RuntimeError):
    """An ``ip`` command failed, or the machine cannot host a fleet."""


def unavailable_reason() -> str | None:
    """Why no fleet can be built here (None when it can): root and ``ip netns`` are needed."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        subprocess.run(["ip", "netns", "list"], capture_output=True, check=True, timeout=10)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns` does not work here: {exc}"
    return None


def ip(*args: str, ns: str | None = None, check: bool = True) -> str:
    """Run ``ip [-n ns] args...``; its stdout. Raises FleetError with stderr on failure."""
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=30)
    if check and proc.returncode != 0:
        raise FleetError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def netns_names() -> list[str]:
    """Every named network namespace on the machine."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def netns_pids(ns: str) -> list[int]:
    out = ip("netns", "pids", ns, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


# -- joining a namespace ---------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(ns: str) -> None:
    """Move the calling thread into network namespace ``ns``."""
    fd = os.open(NETNS_DIR / ns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


def call_in(ns: str, fn: Callable[..., T], *args: Any, timeout: float = 60.0) -> T:
    """``fn(*args)`` in a fresh thread inside namespace ``ns``; its result or its exception.
    The calling thread stays where it is."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            _setns(ns)
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            box["error"] = exc

    thread = threading.Thread(target=body, name=f"in-{ns}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"call in {ns} did not return within {timeout} s")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


# -- owners and leftovers -------------------------------------------------------------------


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), to tell a pid from a reused one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()[19]


def _owner_alive(tag: str) -> bool:
    try:
        owner = json.loads((OWNER_DIR / tag).read_text())
    except (OSError, ValueError):
        return False
    return bool(owner.get("start")) and _start_time(int(owner["pid"])) == owner["start"]


def _remove_namespace(ns: str) -> None:
    """SIGKILL what still runs inside (ours: only the harness starts processes there), delete
    the name. A namespace with no process left is destroyed with its links."""
    for _ in range(3):
        pids = [p for p in netns_pids(ns) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    ip("netns", "del", ns, check=False)


def sweep(keep_tag: str | None = None) -> list[str]:
    """Delete every ``dct-`` namespace whose fleet's owner is gone (a crashed harness, a
    SIGKILLed test); fleets of live owners (another run at the same time) are left alone.
    Returns the names removed."""
    removed = []
    names = [n for n in netns_names() if n.startswith(PREFIX)]
    dead_tags = set()
    for ns in names:
        m = _NAME.match(ns)
        tag = m.group("tag") if m else None
        if tag is not None and (tag == keep_tag or _owner_alive(tag)):
            continue
        # Host namespaces first: the bridge's goes last (its deletion destroys every veth).
        removed.append(ns)
        if tag is not None:
            dead_tags.add(tag)
    removed.sort(key=lambda n: n.endswith(f"-{BRIDGE_HOST}"))
    for ns in removed:
        _remove_namespace(ns)
    for tag in dead_tags:
        with contextlib.suppress(OSError):
            (OWNER_DIR / tag).unlink()
    if removed:
        log.warning("removed leftover namespaces of a fleet whose owner is gone: %s", removed)
    return removed


# Detached, in a session of its own: when the owner dies without tearing down, wait for the
# servers' and workers' own watchdogs (they stop their processes within a few seconds), then
# kill what is left in the fleet's namespaces and delete them, bridge last.
_WATCHDOG_SH = r"""
owner=$1 tag=$2
while kill -0 "$owner" 2>/dev/null; do sleep 1; done
sleep 3
for pass in hosts bridge; do
    for ns in $(ip netns list | awk '{print $1}' | grep "^dct-$tag-"); do
        if [ "$pass" = hosts ] && [ "$ns" = "dct-$tag-br" ]; then continue; fi
        for pid in $(ip netns pids "$ns"); do kill -s KILL "$pid" 2>/dev/null; done
        sleep 0.2
        ip netns del "$ns" 2>/dev/null
    done
done
rm -f "/run/dct-fleet/$tag"
"""


@dataclass(frozen=True)
class Host:
    name: str  # e.g. "pg", "steps0"
    ns: str  # dct-<tag>-<name>
    addr: str  # 10.213.7.N
    port: str  # its veth's end on the bridge: dct-h<N>
    roles: tuple[str, ...] = ()


class Fleet:
    """Hosts in network namespaces on one bridge. ``create()``, then use, then
    ``teardown()`` (idempotent; also run at exit)."""

    def __init__(self, *, subnet: str = DEFAULT_SUBNET, tag: str | None = None) -> None:
        self.net = ipaddress.ip_network(subnet)
        if not self.net.is_private or self.net.prefixlen < 16:
            raise FleetError(f"{subnet}: a fleet's subnet must be private and small")
        self.tag = tag or f"f{os.getpid()}"
        self.hosts: dict[str, Host] = {}
        #: Named groups of hosts a partition can name: "db" -> ["pg", "pgbouncer"], ...
        self.groups: dict[str, list[str]] = {}
        self._cuts: Counter[tuple[str, str, str]] = Counter()  # (from, to, method)
        self._down: Counter[str] = Counter()  # hosts whose bridge port is down
        self._lock = threading.RLock()
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._created = False
        self._owner_pid = os.getpid()

    # -- names -----------------------------------------------------------------------------

    @property
    def bridge_ns(self) -> str:
        return f"{PREFIX}{self.tag}-{BRIDGE_HOST}"

    def ns_of(self, host: str) -> str:
        return self.hosts[host].ns

    def addr(self, host: str) -> str:
        return self.hosts[host].addr

    def namespaces(self) -> list[str]:
        """Every namespace of the fleet: the hosts' and the bridge's (the report's ``hosts``)."""
        return [h.ns for h in self.hosts.values()] + ([self.bridge_ns] if self._created else [])

    def exec_prefix(self, host: str) -> list[str]:
        """Put before a command to run it in ``host``: the process is the command itself
        (``ip netns exec`` execs it, so its pid is the command's)."""
        return ["ip", "netns", "exec", self.ns_of(host)]

    # -- building and tearing down -------------------------------------------------------------

    def create(self, hosts: Iterable[str], roles: dict[str, Iterable[str]] | None = None) -> None:
        """The bridge and one namespace per host name (``[a-z0-9]+``, not "br"), each with its
        address. Sweeps leftovers of dead fleets first."""
        if self._created:
            raise FleetError("fleet already created")
        names = list(hosts)
        bad = [n for n in names if not re.fullmatch(r"[a-z0-9]{1,20}", n) or n == BRIDGE_HOST]
        if bad or len(set(names)) != len(names):
            raise FleetError(f"bad or repeated host names: {names}")
        if len(names) > self.net.num_addresses - FIRST_HOST - 2:
            raise FleetError(f"{len(names)} hosts do not fit in {self.net}")
        if reason := unavailable_reason():
            raise FleetError(reason)
        sweep(keep_tag=self.tag)
        OWNER_DIR.mkdir(parents=True, exist_ok=True)
        (OWNER_DIR / self.tag).write_text(
            json.dumps({"pid": os.getpid(), "start": _start_time(os.getpid())})
        )
        self._created = True
        atexit.register(self.teardown)
        self._watchdog = subprocess.Popen(
            ["sh", "-c", _WATCHDOG_SH, "dct-fleet-watchdog", str(os.getpid()), self.tag],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        roles = {k: tuple(v) for k, v in (roles or {}).items()}
        try:
            br = self.bridge_ns
            ip("netns", "add", br)
            ip("link", "set", "lo", "up", ns=br)
            ip("link", "add", BRIDGE, "type", "bridge", ns=br)
            ip("link", "set", BRIDGE, "up", ns=br)
            for i, name in enumerate(names):
                addr = str(self.net.network_address + FIRST_HOST + i)
                host = Host(
                    name, f"{PREFIX}{self.tag}-{name}", addr, f"dct-h{i}", roles.get(name, ())
                )
                self._add_host(host)
                self.hosts[name] = host
        except BaseException:
            self.teardown()
            raise

    def _add_host(self, host: Host) -> None:
        ns, br = host.ns, self.bridge_ns
        ip("netns", "add", ns)
        # No IPv6 at all: no link-local addresses, no router solicitations.
        call_in(ns, _disable_ipv6)
        ip("link", "set", "lo", "up", ns=ns)
        # Created inside the host with its peer inside the bridge's namespace: the root
        # namespace never holds either end, not even for a moment.
        ip("link", "add", IFACE, "type", "veth", "peer", "name", host.port, "netns", br, ns=ns)
        ip("link", "set", host.port, "master", BRIDGE, "up", ns=br)
        ip("addr", "add", f"{host.addr}/{self.net.prefixlen}", "dev", IFACE, ns=ns)
        ip("link", "set", IFACE, "up", ns=ns)

    def teardown(self) -> None:
        """Heal nothing, keep nothing: kill what runs in the fleet's namespaces, delete them
        (hosts, then the bridge), stop the watchdog. Idempotent."""
        if os.getpid() != self._owner_pid:
            return  # a forked child's atexit
        with self._lock:
            if not self._created:
                return
            for host in list(self.hosts.values()):
                with contextlib.suppress(Exception):
                    _remove_namespace(host.ns)
            with contextlib.suppress(Exception):
                _remove_namespace(self.bridge_ns)
            with contextlib.suppress(OSError):
                (OWNER_DIR / self.tag).unlink()
            if self._watchdog is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._watchdog.pid, signal.SIGKILL)
                with contextlib.suppress(Exception):
                    self._watchdog.wait(5)
                self._watchdog = None
            self._cuts.clear()
            self._down.clear()
            self._created = False

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGHUP raise SystemExit in the main thread (SIGINT already raises
        KeyboardInterrupt), so ``finally`` blocks, ExitStacks and atexit run: the fleet is
        torn down when the harness is stopped."""

        def stop(signum: int, _frame: Any) -> None:
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, stop)

    # -- running code in a host ----------------------------------------------------------------

    def enter(self, host: str) -> None:
        """Move the calling thread into ``host`` for good (threads it starts afterwards, and
        processes it spawns, are there as well), and check it is there: a thread left in the
        root namespace would send what it meant for the fleet along the machine's default
        route."""
        _setns(self.ns_of(host))
        if not self.inside(host):
            raise FleetError(f"setns into {self.ns_of(host)} did not take")

    def inside(self, host: str) -> bool:
        """Is the calling thread in ``host``'s namespace?"""
        mine = os.stat(f"/proc/self/task/{threading.get_native_id()}/ns/net")
        theirs = os.stat(NETNS_DIR / self.ns_of(host))
        return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)

    def call_in(self, host: str, fn: Callable[..., T], *args: Any, timeout: float = 60.0) -> T:
        return call_in(self.ns_of(host), fn, *args, timeout=timeout)

    def run(self, host: str, *cmd: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run a short command in ``host`` and wait for it."""
        return subprocess.run(
            [*self.exec_prefix(host), *cmd],
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
        )

    # -- faults ---------------------------------------------------------------------------------

    def peers(self, target: str | Iterable[str]) -> list[str]:
        """Host names for a group name ("db", "broker"), a host name, or a list of them."""
        names = [target] if isinstance(target, str) else list(target)
        out: list[str] = []
        for name in names:
            for h in self.groups.get(name, [name]):
                if h not in self.hosts:
                    raise FleetError(f"no host {h!r} (of {name!r}) in the fleet")
                if h not in out:
                    out.append(h)
        return out

    def partition(
        self,
        host: str,
        from_: str | Iterable[str] = "all",
        *,
        direction: str = "both",
        method: str = "drop",
    ) -> dict[str, Any]:
        """Cut ``host`` from ``from_``: "all" (its bridge port down), or a group or host names
        (``direction`` "both", "out", "in"; ``method`` "drop", "blackhole", "prohibit").
        Returns what was done (for the fault's report)."""
        if host not in self.hosts:
            raise FleetError(f"no host {host!r}")
        with self._lock:
            if from_ == "all":
                self._port(host, up=False)
                return {"cut": "all", "port": self.hosts[host].port}
            if direction not in ("both", "out", "in") or method not in (
                "drop",
                "blackhole",
                "prohibit",
            ):
                raise FleetError(f"bad direction {direction!r} or method {method!r}")
            peers = [p for p in self.peers(from_) if p != host]
            for peer in peers:
                if direction in ("both", "out"):
                    self._cut(host, peer, method)
                if direction in ("both", "in"):
                    self._cut(peer, host, method)
            return {"cut": peers, "direction": direction, "method": method}

    def heal(self, host: str | None = None) -> None:
        """Undo every cut involving ``host`` (every cut, when None), bring ports back up."""
        with self._lock:
            for a, b, method in list(self._cuts):
                if host is None or host in (a, b):
                    while self._cuts[(a, b, method)] > 0:
                        self._uncut(a, b, method)
            for name in list(self._down):
                if host is None or name == host:
                    while self._down[name] > 0:
                        self._port(name, up=True)

    def flap(
        self,
        host: str,
        period: float,
        duration: float,
        stop: threading.Event | None = None,
    ) -> int:
        """Take ``host``'s bridge port down and up every ``period / 2`` s for ``duration`` s
        (blocks); ends up. Returns the number of down phases."""
        half = max(0.02, period / 2.0)
        deadline = time.monotonic() + duration
        downs = 0
        try:
            while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
                self._port(host, up=False)
                downs += 1
                time.sleep(min(half, max(0.0, deadline - time.monotonic())))
                self._port(host, up=True)
                time.sleep(min(half, max(0.0, deadline - time.monotonic())))
        finally:
            with self._lock:
                while self._down[host] > 0:
                    self._port(host, up=True)
        return downs

    def active_cuts(self) -> dict[str, Any]:
        with self._lock:
            return {
                "cuts": sorted(f"{a}->{b} ({m})" for (a, b, m), n in self._cuts.items() if n),
                "down": sorted(h for h, n in self._down.items() if n),
            }

    # -- plumbing of the faults ----------------------------------------------------------------

    def _cut(self, src: str, dst: str, method: str) -> None:
        """Packets from ``src`` to ``dst`` are lost (refcounted: two cuts, two heals)."""
        key = (src, dst, method)
        if self._cuts[key] == 0:
            ns, addr = self.ns_of(src), self.addr(dst)
            if method == "drop":
                ip(
                    "neigh", "replace", addr, "lladdr", NOWHERE_MAC, "dev", IFACE,
                    "nud", "permanent", ns=ns,
                )  # fmt: skip
            else:
                ip("route", "add", method, f"{addr}/32", ns=ns)
        self._cuts[key] += 1

    def _uncut(self, src: str, dst: str, method: str) -> None:
        key = (src, dst, method)
        if self._cuts[key] <= 0:
            return
        self._cuts[key] -= 1
        if self._cuts[key] == 0:
            del self._cuts[key]
            ns, addr = self.ns_of(src), self.addr(dst)
            if method == "drop":
                # The kernel resolves the address again with ARP on the next packet.
                ip("neigh", "del", addr, "dev", IFACE, ns=ns, check=False)
            else:
                ip("route", "del", method, f"{addr}/32", ns=ns, check=False)

    def _port(self, host: str, *, up: bool) -> None:
        """The host's port on the bridge, down (refcounted) or up."""
        port = self.hosts[host].port
        with self._lock:
            if up:
                if self._down[host] <= 0:
                    return
                self._down[host] -= 1
                if self._down[host] == 0:
                    del self._down[host]
                    ip("link", "set", port, "up", ns=self.bridge_ns)
            else:
                if self._down[host] == 0:
                    ip("link", "set", port, "down", ns=self.bridge_ns)
                self._down[host] += 1


def _disable_ipv6() -> None:
    # /proc/sys/net is the namespace of the thread that opens it.
    for key in ("all", "default"):
        with contextlib.suppress(OSError):
            Path(f"/proc/sys/net/ipv6/conf/{key}/disable_ipv6").write_text("1\n")


def root_leaks(net: str = DEFAULT_SUBNET) -> list[str]:
    """What of a fleet shows in the calling thread's namespace (the root one, for a caller
    that never entered a host): links named ``dct-*``, addresses or routes in ``net``."""
    network = ipaddress.ip_network(net)
    leaks = []
    for line in ip("-o", "link", "show").splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(PREFIX):
            leaks.append(f"link {name}")
    for line in ip("-o", "-4", "addr", "show").splitlines():
        m = re.search(r"inet (\S+)/", line)
        if m and ipaddress.ip_address(m.group(1)) in network:
            leaks.append(f"address {line.strip()}")
    for line in ip("-4", "route", "show", "table", "all").splitlines():
        first = line.split()[0] if line.split() else ""
        target = line.split()[1] if first in ("blackhole", "prohibit", "unreachable") else first
        with contextlib.suppress(ValueError):
            if target != "default" and ipaddress.ip_network(target, strict=False).overlaps(network):
                leaks.append(f"route {line.strip()}")
    return leaks
