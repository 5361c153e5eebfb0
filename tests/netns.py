"""Network namespaces for tests and benchmarks (import as `netns`; bench/shards.py uses it too).

* :class:`Namespaces`: a bridge and one namespace per host, each with an upload cap (tc tbf), for
  the checkpoint swarm benchmark;
* :class:`NatTopology`: a "public" bridge with public hosts and home routers, and behind each router
  a "home" namespace whose traffic the router source-NATs (nftables masquerade), no port
  forwarding: a home host can dial out, nobody can dial in.

Everything created is deleted again on exit (also after errors); a leftover of an earlier crashed
run with the same names is deleted first. Needs root, ``ip`` (iproute2), ``tc``, and ``nft`` for NAT.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


def sh(*cmd: str) -> None:
    """Run a command; CalledProcessError with its stderr when it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)


def in_ns(ns: str, *cmd: str) -> None:
    sh("ip", "netns", "exec", ns, *cmd)


def missing_for_namespaces(nat: bool = False) -> str | None:
    """Why namespace tests cannot run here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    tools = ["ip", "tc", "nft"] if nat else ["ip", "tc"]
    for tool in tools:
        if shutil.which(tool) is None:
            return f"needs `{tool}` (apt-get install {'nftables' if tool == 'nft' else 'iproute2'})"
    probe = subprocess.run(["ip", "netns", "add", "swarmprobe"], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", "swarmprobe"], capture_output=True)
    if probe.returncode != 0:
        return f"`ip netns add` fails here: {probe.stderr.strip()}"
    return None


def _add_ns(ns: str) -> None:
    sh("ip", "netns", "add", ns)
    in_ns(ns, "ip", "link", "set", "lo", "up")


def _veth(ns: str, inner: str, outer: str, addr: str, bridge: str | None = None, peer_ns: str | None = None) -> None:
    """A veth pair: ``inner`` inside ``ns`` with ``addr``; ``outer`` on ``bridge`` or in ``peer_ns``."""
    sh("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
    sh("ip", "link", "set", inner, "netns", ns)
    in_ns(ns, "ip", "addr", "add", addr, "dev", inner)
    in_ns(ns, "ip", "link", "set", inner, "up")
    if bridge is not None:
        sh("ip", "link", "set", outer, "master", bridge)
        sh("ip", "link", "set", outer, "up")
    elif peer_ns is not None:
        sh("ip", "link", "set", outer, "netns", peer_ns)
        in_ns(peer_ns, "ip", "link", "set", outer, "up")


class Namespaces:
    """A bridge and one namespace per host, each with an upload cap (tc tbf on its veth)."""

    def __init__(self, count: int, mbit: float, prefix: str = "shb") -> None:
        self.names = [f"{prefix}{i}" for i in range(count)]
        self.bridge = f"{prefix}br"
        self.mbit = mbit

    def ip(self, i: int) -> str:
        return f"10.77.0.{i + 1}"

    def __enter__(self) -> "Namespaces":
        self.__exit__()
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
            _add_ns(ns)
            _veth(ns, f"{ns}a", f"{ns}b", f"{self.ip(i)}/24", bridge=self.bridge)
            # Upload cap: what leaves this host. Burst ~ a few ms of traffic, as a real link.
            in_ns(ns, "tc", "qdisc", "add", "dev", f"{ns}a", "root", "tbf",
                  "rate", f"{self.mbit}mbit", "burst", "64kb", "latency", "100ms")
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            subprocess.run(["ip", "link", "del", f"{ns}b"], capture_output=True)  # if a process kept the ns
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


# A home router: forward what its home side sends, masquerade it behind the router's public
# address, and let back in only replies to connections the home side opened (conntrack). No port
# forwarding, so a connection opened from the public side to the router finds nothing.
ROUTER_RULES = """
table ip swarmnat {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "{wan}" masquerade
    }}
    chain forward {{
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "{lan}" oifname "{wan}" accept
    }}{input}
}}
"""
# Optional: what many consumer routers do with a connection attempt from outside that matches
# nothing: drop it silently, instead of the kernel's answer to a closed port (a TCP RST).
SILENT_INPUT = """
    chain input {
        type filter hook input priority filter; policy accept;
        iifname "%s" ct state new drop
    }"""


@dataclass
class NatTopology:
    """``public`` hosts on one bridge (10.78.0.0/24); per home, a router on that bridge and one host
    behind it (192.168.<k>.2, the router's LAN side is .1) that only the router's NAT lets out."""

    public: list[str]
    homes: list[str]
    prefix: str = "nat"
    silent_drop: bool = False  # routers drop unsolicited inbound connections instead of refusing them

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    def ns(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def router(self, home: str) -> str:
        return self.ns(f"r{self.homes.index(home) + 1}")

    def ip(self, name: str) -> str:
        """The host's own address (a home host's is private: only its router can reach it)."""
        if name in self.public:
            return f"10.78.0.{self.public.index(name) + 1}"
        return f"192.168.{self.homes.index(name) + 1}.2"

    def router_ip(self, home: str) -> str:
        """The router's public address: what the public side sees a home host's connections come from."""
        return f"10.78.0.{100 + self.homes.index(home) + 1}"

    def _all(self) -> list[str]:
        return [self.ns(n) for n in self.public] + [self.router(h) for h in self.homes] + [self.ns(h) for h in self.homes]

    def __enter__(self) -> "NatTopology":
        self.__exit__()
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            sh("ip", "link", "set", self.bridge, "up")
            for i, name in enumerate(self.public):
                ns = self.ns(name)
                _add_ns(ns)
                _veth(ns, f"{self.prefix}p{i}a", f"{self.prefix}p{i}b", f"{self.ip(name)}/24", bridge=self.bridge)
            for k, home in enumerate(self.homes, start=1):
                router, host = self.router(home), self.ns(home)
                _add_ns(router)
                _add_ns(host)
                wan, lan = f"{self.prefix}w{k}", f"{self.prefix}l{k}"
                _veth(router, wan, f"{self.prefix}w{k}b", f"{self.router_ip(home)}/24", bridge=self.bridge)
                _veth(host, f"{self.prefix}h{k}", lan, f"{self.ip(home)}/24", peer_ns=router)
                in_ns(router, "ip", "addr", "add", f"192.168.{k}.1/24", "dev", lan)
                in_ns(host, "ip", "route", "add", "default", "via", f"192.168.{k}.1")
                in_ns(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
                rules = ROUTER_RULES.format(wan=wan, lan=lan, input=SILENT_INPUT % wan if self.silent_drop else "")
                subprocess.run(["ip", "netns", "exec", router, "nft", "-f", "-"], input=rules, text=True,
                               check=True, capture_output=True)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in self._all():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for i in range(len(self.public)):
            subprocess.run(["ip", "link", "del", f"{self.prefix}p{i}b"], capture_output=True)
        for k in range(1, len(self.homes) + 1):
            subprocess.run(["ip", "link", "del", f"{self.prefix}w{k}b"], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def exec_prefix(self, name: str) -> list[str]:
        """Prefix a command with this to run it inside ``name``'s namespace."""
        return ["ip", "netns", "exec", self.ns(name)]
