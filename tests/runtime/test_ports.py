"""aligner.runtime.ports.free_port: a bindable port below the kernel's ephemeral range."""

from __future__ import annotations

import socket

from aligner.runtime import ports


def test_free_ports_are_bindable_and_below_the_ephemeral_range():
    low, high = ports.ephemeral_range()
    assert 1024 <= low < high
    got = {ports.free_port() for _ in range(20)}
    for port in got:
        assert ports.LOWEST <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # free now
    assert len(got) > 1  # drawn at random


def test_a_taken_port_is_never_returned(monkeypatch):
    """With the range narrowed to [p, p + 1000) and p held, the draw skips p."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        p = held.getsockname()[1]
        monkeypatch.setattr(ports, "LOWEST", p)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (p + 1000, p + 2000))
        assert all(ports.free_port() != p for _ in range(50))


def test_falls_back_to_the_os_choice_when_the_range_starts_too_low(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST + 10, 60999))
    port = ports.free_port()
    assert port > 0
