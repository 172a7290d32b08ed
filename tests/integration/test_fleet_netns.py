"""The fleet's plumbing (chaos/fleet.py, docs/fleet.md): hosts in network namespaces on a
private bridge, partitions, flapping, clean-up. Real namespaces and real TCP; no server, no
database; a few seconds in all. Skipped where namespaces cannot be made (not root, no
``ip netns``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

CHAOS = Path(__file__).resolve().parents[2] / "chaos"
sys.path.insert(0, str(CHAOS))

import fleet  # noqa: E402

pytestmark = pytest.mark.skipif(
    fleet.unavailable_reason() is not None,
    reason=f"no network namespaces here: {fleet.unavailable_reason()}",
)

PORT = 7070


def _ours() -> list[str]:
    return [n for n in fleet.netns_names() if n.startswith(fleet.PREFIX)]


@pytest.fixture
def hosts() -> Iterator[fleet.Fleet]:
    f = fleet.Fleet()
    f.create(["db", "mq", "a", "b"])
    f.groups.update(db=["db"], broker=["mq"])
    listeners = [f.call_in(h, _listen, f.addr(h)) for h in ("db", "mq")]
    yield f
    for s in listeners:
        s.close()
    f.teardown()


def _listen(addr: str) -> socket.socket:
    """A listener that accepts and closes every connection (its backlog never fills)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, PORT))
    s.listen(64)

    def serve() -> None:
        while True:
            try:
                conn, _ = s.accept()
            except OSError:
                return  # closed
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return s


def _connect(addr: str, timeout: float = 0.6) -> str:
    """ "ok", "timeout" (nothing came back), or the error's name."""
    try:
        socket.create_connection((addr, PORT), timeout).close()
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return type(exc).__name__
    return "ok"


def reach(f: fleet.Fleet, src: str, dst: str) -> str:
    return f.call_in(src, _connect, f.addr(dst))


def restored(f: fleet.Fleet, src: str, dst: str) -> str:
    """After a heal: the neighbour entry may have to be learned again (ARP retries once a
    second), so allow a few seconds."""
    return f.call_in(src, _connect, f.addr(dst), 3.0)


def test_hosts_talk_over_the_bridge_and_the_root_namespace_sees_nothing(
    hosts: fleet.Fleet,
) -> None:
    assert reach(hosts, "a", "db") == "ok"
    assert reach(hosts, "b", "mq") == "ok"
    assert len({h.addr for h in hosts.hosts.values()}) == 4
    assert all(h.ns.startswith(f"dct-{hosts.tag}-") for h in hosts.hosts.values())
    # The root namespace has no link, address or route of the fleet (and nothing here sends
    # from it to the fleet's addresses: its default route leads off the machine).
    assert fleet.root_leaks() == []
    # A host has no way out: no default route, only its /24.
    routes = fleet.ip("-4", "route", "show", ns=hosts.ns_of("a")).splitlines()
    assert routes == [r for r in routes if r.startswith("10.213.7.0/24 ")], routes
    assert len(routes) == 1


def test_a_partition_from_the_database_cuts_exactly_that_host_from_exactly_that(
    hosts: fleet.Fleet,
) -> None:
    hosts.partition("a", "db")
    assert reach(hosts, "a", "db") == "timeout"  # silent, as a real partition is
    assert reach(hosts, "a", "mq") == "ok"
    assert reach(hosts, "b", "db") == "ok"
    hosts.heal("a")
    assert restored(hosts, "a", "db") == "ok"


def test_a_partition_from_the_broker_and_from_everything(hosts: fleet.Fleet) -> None:
    hosts.partition("b", "broker")
    assert (reach(hosts, "b", "mq"), reach(hosts, "b", "db")) == ("timeout", "ok")
    hosts.heal()
    hosts.partition("b", "all")
    assert (reach(hosts, "b", "mq"), reach(hosts, "b", "db")) == ("timeout", "timeout")
    assert reach(hosts, "a", "db") == "ok"
    assert hosts.active_cuts()["down"] == ["b"]
    hosts.heal()
    assert (restored(hosts, "b", "mq"), restored(hosts, "b", "db")) == ("ok", "ok")
    assert hosts.active_cuts() == {"cuts": [], "down": []}


def test_one_way_the_requests_arrive_and_the_answers_are_lost(hosts: fleet.Fleet) -> None:
    """direction="in": what the host sends gets there, what comes back does not (a COMMIT
    that commits, its answer lost)."""

    def udp_server() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((hosts.addr("db"), PORT))
        s.settimeout(1.0)
        return s

    server = hosts.call_in("db", udp_server)

    def ask() -> str:
        c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        c.settimeout(0.6)
        c.sendto(b"commit", (hosts.addr("db"), PORT))
        try:
            return c.recv(100).decode()
        except TimeoutError:
            return "no answer"
        finally:
            c.close()

    def serve_one() -> None:
        data, peer = server.recvfrom(100)
        server.sendto(b"committed:" + data, peer)

    try:
        hosts.partition("a", "db", direction="in")
        t = threading.Thread(target=serve_one)
        t.start()
        assert hosts.call_in("a", ask) == "no answer"
        t.join(3)
        assert not t.is_alive(), "the request did not arrive"
        hosts.heal()
        t = threading.Thread(target=serve_one)
        t.start()
        assert hosts.call_in("a", ask) == "committed:commit"
        t.join(3)
    finally:
        server.close()


def test_route_methods_fail_fast_instead_of_silently(hosts: fleet.Fleet) -> None:
    hosts.partition("a", "db", method="prohibit")
    assert reach(hosts, "a", "db") == "PermissionError"
    hosts.heal()
    hosts.partition("a", "db", direction="out", method="blackhole")
    assert reach(hosts, "a", "db") != "ok"
    hosts.heal()
    assert restored(hosts, "a", "db") == "ok"


def test_flapping_link(hosts: fleet.Fleet) -> None:
    results: list[str] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            results.append(hosts.call_in("a", _connect, hosts.addr("db"), 0.15))

    t = threading.Thread(target=probe)
    t.start()
    # Half a second up and down: with 0.15 s phases a loaded machine (a fresh-clone CI run)
    # had every probe time out, none of them landing in an up phase long enough to connect.
    downs = hosts.flap("a", period=1.0, duration=5.0)
    stop.set()
    t.join()
    assert downs >= 4
    assert "ok" in results and "timeout" in results, results
    assert hosts.active_cuts()["down"] == []
    assert restored(hosts, "a", "db") == "ok"


def test_teardown_leaves_nothing_and_the_sweep_removes_a_dead_owners_leftovers() -> None:
    f = fleet.Fleet()
    f.create(["x", "y"])
    names = f.namespaces()
    assert set(names) <= set(_ours())
    f.teardown()
    assert not set(names) & set(_ours())
    assert fleet.root_leaks() == []
    # A leftover whose owner is gone (no such pid): the next fleet's create() sweeps it.
    fleet.ip("netns", "add", "dct-f999999999-old")
    g = fleet.Fleet()
    try:
        g.create(["z"])
        assert "dct-f999999999-old" not in _ours()
        # ... but a live fleet is left alone by another one's sweep.
        assert fleet.sweep() == []
        assert g.ns_of("z") in _ours()
    finally:
        g.teardown()
    assert not [n for n in _ours() if n.startswith(f"dct-{g.tag}-")]


@pytest.mark.slow
def test_a_harness_killed_with_sigkill_leaves_nothing_behind() -> None:
    code = (
        f"import os, signal, sys; sys.path.insert(0, {str(CHAOS)!r}); import fleet; "
        "f = fleet.Fleet(); f.create(['p', 'q']); print(f.tag, flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
    )
    assert proc.returncode == -9, proc.stderr
    tag = proc.stdout.strip()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [n for n in _ours() if f"-{tag}-" in n]:
        time.sleep(0.2)
    assert not [n for n in _ours() if f"-{tag}-" in n]
    assert not (fleet.OWNER_DIR / tag).exists()
    assert os.path.exists("/run/netns")


def test_entering_a_host_moves_one_thread_only(hosts: fleet.Fleet) -> None:
    assert not hosts.inside("a")
    assert hosts.call_in("a", lambda: hosts.inside("a"))
    assert not hosts.inside("a")
