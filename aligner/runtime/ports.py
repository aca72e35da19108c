"""A TCP port for a rendezvous: chosen below the kernel's ephemeral range.

A port found free by binding port 0 comes from the ephemeral range (Linux: 32768-60999,
``/proc/sys/net/ipv4/ip_local_port_range``), the same range from which the kernel picks the local
port of every outgoing connection. Between the moment the port is found and the moment the
rendezvous binds it (seconds: a Ray actor is set up, a process group is created), any new
connection on the node (Ray's RPCs, gloo's pairwise links, another run's) may take it, and the
bind fails with EADDRINUSE: seen with two test sessions at once on 2026-11-26. A port drawn at
random below the ephemeral range is never handed out by the kernel; only another explicit choice
can take it (two draws collide with probability about 1 in 20,000).
"""

from __future__ import annotations

import random
import socket

LOWEST = 10000  # below: well-known and registered services more often sit there
TRIES = 64


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (low, high); Linux's default where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, drawn at random in [LOWEST, the ephemeral range's low end) so
    that no outgoing connection is given it before it is bound; the OS's choice (port 0) when the
    ephemeral range starts too low or TRIES draws were taken."""
    low, _ = ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(TRIES if low - LOWEST >= 1000 else 0):
        port = rng.randrange(LOWEST, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
