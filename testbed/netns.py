"""Hosts in their own network namespaces, for tests of the fleet topology on one machine.

Why: in production a worker host is another machine. It reaches Prefect and S3 over the
network and can never reach a process on another machine through 127.0.0.1. Run on this
machine in the root namespace, a worker would see every loopback service (PostgreSQL, the
other workers, the API replicas), so a test could pass only because something was
accidentally reachable on 127.0.0.1. Here every host gets its own network namespace with its
own loopback, joined to the root namespace by a veth pair on a private bridge:

    root namespace                          host namespace "rhn-<tok>-<name>"
    bridge rhn-<tok>  10.a.b.1/24  <--veth-->  eth0 10.a.b.n/24, lo, default via 10.a.b.1
    (servers the hosts must reach bind here)

Usage:

    with Network() as net:
        server = start_server(host=net.gateway)          # root namespace, on the bridge
        worker = net.add_host("w0")
        proc = subprocess.Popen(worker.argv([sys.executable, "-m", ...]), env=env)
        worker.kill_all()                                  # the machine is lost

A host has no DNS: its /etc/resolv.conf (through /etc/netns/<netns>/, removed at exit) names
no nameserver, so a lookup fails at once instead of hanging 10 s on the machine's nameserver,
which a host cannot reach. Use IP addresses (the gateway's, a host's `ip`); "localhost" is the
host's own loopback. What a host can reach in the root namespace is what listens on the
gateway's address, which includes every root service bound to 0.0.0.0 (but not PostgreSQL or
anything else bound to 127.0.0.1 only).

Needs root and iproute2's `ip`; without them it raises NetnsError (a test that wants hosts
must not silently run without isolation). Everything is removed on exit, also when the test
fails; a test session that was itself SIGKILLed leaves its interfaces behind, and the next
Network() sweeps them (their owner process is gone).
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
import warnings
from collections.abc import Sequence

__all__ = ["Network", "Host", "NetnsError", "sweep_stale"]

# Every name we create starts with this, then 6 random hex chars (the network's token), so
# two test sessions on one machine never clash and leftovers are recognisable. Interface
# names are limited to 15 chars: "rhn-abcdef" (bridge) and "rhn-abcdef-254" (veth) fit.
PREFIX = "rhn"
# Written into the bridge's alias: who owns it, so a later sweep can tell a live session's
# network from one whose test process died without tearing down.
_ALIAS_TAG = "residual-harvest testbed.netns owner="
_ETC_NETNS = "/etc/netns"
_TOKEN_RE = re.compile(rf"^{PREFIX}-([0-9a-f]{{6}})(?:-|$)")


class NetnsError(RuntimeError):
    """A namespace, link or address could not be set up or torn down."""


def _ip_binary() -> str:
    path = shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip") if os.path.exists(p)), None)
    if path is None:
        raise NetnsError("testbed.netns needs iproute2's `ip` (apt-get install iproute2); none found on PATH")
    return path


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([_ip_binary(), *args], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _link_exists(name: str) -> bool:
    # Our own /sys is the root namespace's sysfs: cheaper than forking `ip link show`.
    return os.path.exists(f"/sys/class/net/{name}")


def _netns_exists(name: str) -> bool:
    return os.path.exists(f"/run/netns/{name}")


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/<pid>/stat): with the pid it
    names one process for good, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_tag() -> str:
    return f"{_ALIAS_TAG}{os.getpid()}:{_start_time(os.getpid())}"


def _owner_alive(alias: str) -> bool:
    try:
        pid, start = alias[len(_ALIAS_TAG):].split(":", 1)
        return _start_time(int(pid)) == start
    except ValueError:
        return True  # not ours to judge: leave it alone


def _netns_pids(netns: str) -> list[int]:
    proc = _ip("netns", "pids", netns, check=False)
    if proc.returncode != 0:
        if not _netns_exists(netns):
            return []
        raise NetnsError(f"`ip netns pids {netns}` failed: {proc.stderr.strip()}")
    return [int(p) for p in proc.stdout.split()]


def _kill_all(netns: str, timeout: float) -> None:
    """SIGKILL every process in `netns` at once and wait until none is left.

    First SIGSTOP everything (again and again until no new process shows up: one may fork
    between our listing and its stop), then SIGKILL them all: no process gets to see a
    sibling die and react (e.g. a flow-run process reporting "crashed"), as on a lost machine.
    Zombies are not listed by `ip netns pids` (an exited task has left its namespace), so an
    un-reaped Popen child does not keep this waiting.
    """
    deadline = time.monotonic() + timeout
    stopped: set[int] = set()
    while True:
        pids = set(_netns_pids(netns))
        if not pids:
            return
        new = pids - stopped
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        stopped |= new
        if time.monotonic() > deadline:
            break
    while True:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
        pids = set(_netns_pids(netns))
        if not pids:
            return
        if time.monotonic() > deadline:
            raise NetnsError(f"processes {sorted(pids)} still in namespace {netns} after SIGKILL and {timeout:.0f} s")


def _delete_netns(netns: str, veth: str | None, timeout: float = 10) -> list[str]:
    """Kill the namespace's processes, delete its veth and the namespace; the errors, if any.

    The veth is deleted explicitly from the root side (which deletes its peer too): the kernel
    frees a deleted namespace, and the links inside it, asynchronously and only once no
    process holds it, so `ip netns del` alone can leave the root end behind for a while.
    """
    errors = []
    try:
        _kill_all(netns, timeout)
    except NetnsError as e:
        errors.append(str(e))
    if veth and _link_exists(veth):
        proc = _ip("link", "del", veth, check=False)
        if proc.returncode != 0 and _link_exists(veth):
            errors.append(f"cannot delete {veth}: {proc.stderr.strip()}")
    if _netns_exists(netns):
        proc = _ip("netns", "del", netns, check=False)
        if proc.returncode != 0 and _netns_exists(netns):
            errors.append(f"cannot delete namespace {netns}: {proc.stderr.strip()}")
    _remove_etc(netns)
    return errors


def _write_etc(netns: str) -> None:
    """Give the namespace a resolv.conf without nameservers (see the module docstring).

    `ip netns exec` bind-mounts /etc/netns/<netns>/* over /etc. Without this, a host uses the
    machine's nameserver, which it cannot reach (the root namespace does not route for it),
    and every lookup of a name not in /etc/hosts -- including the reverse lookup that
    socket.getfqdn() and so http.server make -- hangs for 10 s before failing. With no
    nameserver line glibc asks 127.0.0.1:53, the host's own loopback: refused at once.
    """
    for attempt in range(2):
        try:
            os.makedirs(f"{_ETC_NETNS}/{netns}", exist_ok=True)
            with open(f"{_ETC_NETNS}/{netns}/resolv.conf", "w") as f:
                f.write("# testbed.netns: a test host has no DNS (names fail at once instead of after 10 s)\n")
                f.write("options timeout:1 attempts:1\n")
            return
        except FileNotFoundError:
            if attempt:  # another session removed an empty /etc/netns under our feet: once more
                raise


def _remove_etc(netns: str) -> None:
    shutil.rmtree(f"{_ETC_NETNS}/{netns}", ignore_errors=True)
    try:
        os.rmdir(_ETC_NETNS)  # only when empty: /etc/netns is ours only if nothing else is in it
    except OSError:
        pass


def _bridge_aliases() -> dict[str, str]:
    """Our bridges (by token) and their alias ('' when none is set yet)."""
    found = {}
    for line in _ip("-o", "link", "show", "type", "bridge").stdout.splitlines():
        name = line.split(":", 2)[1].strip().split("@")[0]
        m = _TOKEN_RE.match(name)
        if m and name == f"{PREFIX}-{m.group(1)}":
            alias = re.search(r"\\\s+alias (.*)$", line)
            found[m.group(1)] = alias.group(1).strip() if alias else ""
    return found


def sweep_stale() -> list[str]:
    """Remove what networks of dead test processes left behind; the names removed.

    A session creates its bridge before, and deletes it after, all its namespaces, veths and
    /etc/netns entries. So: list those first, then the bridges. An item whose token had no
    bridge at that later moment belongs to no live session (a session that started after
    our listing has no item in it). A bridge whose alias names a dead owner is stale with all
    its items; a bridge without an alias yet is being created right now and is left alone.
    """
    if os.geteuid() != 0:
        return []
    netns_names = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
    links = os.listdir("/sys/class/net")
    etc = os.listdir(_ETC_NETNS) if os.path.isdir(_ETC_NETNS) else []
    bridges = _bridge_aliases()  # after the listings: see above

    def stale(name: str) -> bool:
        m = _TOKEN_RE.match(name)
        if not m:
            return False
        alias = bridges.get(m.group(1))
        return alias is None or (alias.startswith(_ALIAS_TAG) and not _owner_alive(alias))

    removed = []
    for netns in filter(stale, netns_names):
        _delete_netns(netns, None, timeout=5)
        removed.append(netns)
    for name in filter(stale, links):
        if _link_exists(name) and _ip("link", "del", name, check=False).returncode == 0:
            removed.append(name)
    for netns in filter(stale, etc):
        _remove_etc(netns)
        removed.append(f"{_ETC_NETNS}/{netns}")
    return removed


class Host:
    """One "machine": a network namespace with its own loopback and one address on the bridge.

    ``name`` is the test's name for it, ``netns`` the namespace's name, ``ip`` its address.
    """

    def __init__(self, network: "Network", name: str, netns: str, veth: str, ip: str):
        self.network = network
        self.name = name
        self.netns = netns
        self.veth = veth  # the root-namespace end; the namespace's end is called eth0
        self.ip = ip

    def __repr__(self) -> str:
        return f"Host(name={self.name!r}, netns={self.netns!r}, ip={self.ip!r})"

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run inside this host: ``ip netns exec <netns> *argv``.

        `ip` execs the command in place after entering the namespace, so a Popen's pid, its
        signals and exit status are the command's own. The environment and working directory
        pass through unchanged (pass ``env=`` to Popen as usual); the command is looked up on
        that environment's PATH. `ip netns exec` also gives the command a private mount
        namespace with a fresh /sys (showing the host's interfaces; no cgroup mounts under
        /sys/fs/cgroup) and bind-mounts /etc/netns/<netns>/* over /etc if that exists.
        """
        if isinstance(argv, (str, bytes)):
            raise TypeError("Host.argv takes a list of arguments, not a command string")
        return [_ip_binary(), "netns", "exec", self.netns, *argv]

    def pids(self) -> list[int]:
        """Every live process in this host (zombies excluded); [] once the host is gone."""
        return _netns_pids(self.netns)

    def kill_all(self, timeout: float = 10) -> None:
        """SIGKILL every process of this host at once (the machine is lost, nothing gets to
        clean up) and wait until none is left. The host itself stays usable.

        A process started with ``Popen(host.argv(...))`` a moment ago may still be `ip` in
        the root namespace, not yet switched into the host: wait until its pid shows in
        ``pids()`` before relying on kill_all to catch it. Processes forked inside the host
        (a worker's flow runs) are in it from birth."""
        _kill_all(self.netns, timeout)


class Network:
    """A private bridge in the root namespace, and hosts (namespaces) attached to it.

    ``gateway`` is the bridge's address (10.a.b.1): a root-namespace server the hosts must
    reach binds to it. A context manager; ``close()`` is idempotent and safe after a partial
    set-up. ``add_host`` may be called from several threads at once.
    """

    def __init__(self) -> None:
        # No side effects here: a caller may construct it long before entering it.
        self.token = secrets.token_hex(3)
        self.bridge = f"{PREFIX}-{self.token}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.gateway: str | None = None
        self.hosts: list[Host] = []
        self._lock = threading.Lock()
        self._next_index = 2
        self._names: set[str] = set()
        self._firewall: list[list[str]] = []
        self._entered = False
        self._closed = False

    # --- set-up -------------------------------------------------------------------------------
    def __enter__(self) -> "Network":
        if os.geteuid() != 0:
            raise NetnsError("testbed.netns needs root (network namespaces, bridges and veths); run the tests as root")
        _ip_binary()
        if self._entered:
            raise NetnsError("a Network can be entered only once")
        self._entered = True
        try:
            self._sweep()
            self._create_bridge()
            self._open_firewall()
        except BaseException:
            self.close(raising=False)
            raise
        atexit.register(self._atexit)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # Teardown problems must not hide the test's own failure: then they are only warned.
        self.close(raising=exc_type is None)

    def _sweep(self) -> None:
        try:
            removed = sweep_stale()
        except NetnsError as e:
            warnings.warn(f"testbed.netns: could not sweep stale namespaces: {e}", stacklevel=3)
            return
        if removed:
            warnings.warn(f"testbed.netns: removed leftovers of a dead test session: {removed}", stacklevel=3)

    def _create_bridge(self) -> None:
        # STP off and no forward delay: a new port forwards at once, so a host can talk as soon
        # as add_host returns.
        _ip("link", "add", "name", self.bridge, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _ip("link", "set", "dev", self.bridge, "alias", _owner_tag())
        for _ in range(32):
            subnet = _pick_subnet()
            gateway = str(subnet.network_address + 1)
            _ip("addr", "add", f"{gateway}/{subnet.prefixlen}", "dev", self.bridge)
            # Another session may have picked the same /24 between our look and our add.
            if not _subnet_clash(subnet, self.bridge):
                self.subnet, self.gateway = subnet, gateway
                break
            _ip("addr", "del", f"{gateway}/{subnet.prefixlen}", "dev", self.bridge)
        else:
            raise NetnsError("found no free 10.x.y.0/24 for the test bridge")
        _ip("link", "set", "dev", self.bridge, "up")

    def _open_firewall(self) -> None:
        """Let the bridge's traffic through iptables, if iptables filters anything.

        With br_netfilter loaded and net.bridge.bridge-nf-call-iptables=1, frames bridged
        between two hosts go through iptables' FORWARD chain (the per-bridge nf_call_iptables
        option cannot turn that off: the kernel ORs it with the sysctl); host -> gateway goes
        through INPUT. A Docker-style FORWARD policy of DROP would then silently cut hosts off
        each other. Rules are inserted first in their chain and removed at close. With no
        iptables (or only empty ACCEPT chains) nothing is touched: inserting a rule would load
        the filter table on a machine that has none.
        """
        iptables = shutil.which("iptables")
        if iptables is None:
            return
        listing = subprocess.run([iptables, "-w", "-S"], capture_output=True, text=True)
        if listing.returncode != 0:
            return
        if all(line.startswith("-P ") and line.endswith(" ACCEPT") for line in listing.stdout.splitlines() if line.strip()):
            return
        for rule in (["INPUT", "-i", self.bridge], ["OUTPUT", "-o", self.bridge], ["FORWARD", "-i", self.bridge, "-o", self.bridge]):
            spec = [*rule, "-j", "ACCEPT"]
            proc = subprocess.run([iptables, "-w", "-I", spec[0], "1", *spec[1:]], capture_output=True, text=True)
            if proc.returncode != 0:
                raise NetnsError(f"cannot add iptables rule {spec}: {proc.stderr.strip()}")
            self._firewall.append([iptables, "-w", "-D", *spec])

    def add_host(self, name: str) -> Host:
        """A new host on this network: its own namespace, loopback up, eth0 at 10.a.b.n/24,
        default route via the gateway. Ready to use when this returns."""
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", name):
            raise ValueError(f"host name {name!r}: use 1-40 of [A-Za-z0-9_.-]")
        with self._lock:
            if not self._entered or self._closed or self.subnet is None:
                raise NetnsError("Network is not open: use it as a context manager")
            if name in self._names:
                raise ValueError(f"host {name!r} already exists on this network")
            index = self._next_index
            if index > 254:
                raise NetnsError("a /24 holds at most 253 hosts")
            self._next_index += 1
            self._names.add(name)
            host = Host(self, name, f"{PREFIX}-{self.token}-{name}", f"{PREFIX}-{self.token}-{index}", str(self.subnet.network_address + index))
            # Recorded before anything exists, so close() removes a half-made host too.
            self.hosts.append(host)
        ns, prefix = host.netns, self.subnet.prefixlen
        with _NETNS_ADD_LOCK:
            _ip("netns", "add", ns)
        _write_etc(ns)
        # The peer is created directly inside the namespace: its name (eth0) cannot clash with
        # anything in the root namespace, and the namespace's interface has a familiar name.
        _ip("link", "add", "name", host.veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", "dev", host.veth, "master", self.bridge, "up")
        _ip("-n", ns, "link", "set", "dev", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{host.ip}/{prefix}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "dev", "eth0", "up")
        _ip("-n", ns, "route", "add", "default", "via", self.gateway)
        return host

    # --- teardown -----------------------------------------------------------------------------
    def close(self, raising: bool = True) -> None:
        """Kill every process left in the hosts, delete namespaces, veths, firewall rules and
        the bridge. Idempotent; checks that nothing of this network is left."""
        with self._lock:
            if self._closed or not self._entered:
                return
            self._closed = True  # no add_host from now on
            hosts = list(self.hosts)
        errors: list[str] = []
        for host in reversed(hosts):
            errors += _delete_netns(host.netns, host.veth)
        for rule in self._firewall:
            subprocess.run(rule, capture_output=True)
        self._firewall.clear()
        if _link_exists(self.bridge):
            proc = _ip("link", "del", self.bridge, check=False)
            if proc.returncode != 0 and _link_exists(self.bridge):
                errors.append(f"cannot delete bridge {self.bridge}: {proc.stderr.strip()}")
        atexit.unregister(self._atexit)
        left = self.leftovers()
        if left:
            errors.append(f"left behind: {left}")
        if errors:
            self._closed = False  # a later close() may retry
            message = "testbed.netns teardown: " + "; ".join(errors)
            if raising:
                raise NetnsError(message)
            warnings.warn(message, stacklevel=2)

    def leftovers(self) -> list[str]:
        """Namespaces and interfaces of this network that exist now (empty after close)."""
        mine = f"{PREFIX}-{self.token}"
        names = [n for n in os.listdir("/sys/class/net") if n == mine or n.startswith(mine + "-")]
        netns = _ip("netns", "list", check=False).stdout.split("\n")
        etc = os.listdir(_ETC_NETNS) if os.path.isdir(_ETC_NETNS) else []
        return (
            names
            + [line.split()[0] for line in netns if line.startswith(mine + "-")]
            + [f"{_ETC_NETNS}/{n}" for n in etc if n.startswith(mine + "-")]
        )

    def _atexit(self) -> None:
        # The test process is exiting without having left the `with` (e.g. sys.exit in a
        # fixture): still never leave interfaces behind.
        self.close(raising=False)


# `ip netns add` sets up /run/netns (a shared bind mount) the first time; two first calls at
# once can race on that, so this process makes them one at a time (they take ~1 ms).
_NETNS_ADD_LOCK = threading.Lock()


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine has an address or a route in, and its DNS servers."""
    used = []
    for line in _ip("-4", "-o", "addr", "show").stdout.splitlines():
        m = re.search(r"\binet (\S+)", line)
        if m:
            used.append(ipaddress.ip_network(m.group(1), strict=False))
    route_types = {"unicast", "local", "broadcast", "multicast", "throw", "unreachable", "prohibit", "blackhole", "nat", "anycast"}
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        words = line.split()
        if words and words[0] in route_types:
            words = words[1:]
        if words and words[0] != "default":
            try:
                used.append(ipaddress.ip_network(words[0], strict=False))
            except ValueError:
                pass
    try:
        with open("/etc/resolv.conf") as f:
            for line in f:
                words = line.split()
                if len(words) >= 2 and words[0] == "nameserver":
                    try:
                        used.append(ipaddress.ip_network(words[1]))
                    except ValueError:
                        pass  # an IPv6 server
    except OSError:
        pass
    return [n for n in used if n.version == 4]


def _pick_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    rng = random.SystemRandom()
    for _ in range(1000):
        # 10.16-254.x: clear of the 10.0.x.x ranges that VPNs, Docker and clouds favour.
        subnet = ipaddress.IPv4Network(f"10.{rng.randint(16, 254)}.{rng.randint(0, 255)}.0/24")
        if not any(subnet.overlaps(u) for u in used):
            return subnet
    raise NetnsError("found no free 10.x.y.0/24 for the test bridge")


def _subnet_clash(subnet: ipaddress.IPv4Network, own_dev: str) -> bool:
    for line in _ip("-4", "-o", "addr", "show").stdout.splitlines():
        words = line.split()
        m = re.search(r"\binet (\S+)", line)
        if m and len(words) > 1 and words[1] != own_dev:
            if ipaddress.ip_network(m.group(1), strict=False).overlaps(subnet):
                return True
    return False
